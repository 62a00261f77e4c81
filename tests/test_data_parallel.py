"""Data parallelism with ringify on a (dp, cp) = (2, 2) gloo mesh, HF Llama in float64: 3 AdamW
steps against one process training on the global batch (every gradient and every weight).
DDP around the ringified model, over dp or over all ranks; and per-layer FSDP2:
FSDP over dp, or over the flattened dp x cp (then gradients are reduced once, by FSDP);
its root on the model before ringify or on the ringified module; with and without
activation checkpointing. The rewritten graph runs each block inside its unit's FSDP
hooks, so the blocks' parameters are sharded again after their forward."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from ringify import ringify
from ringify.testing.hf_models import llama

STEPS, BATCH, LENGTH, LAYERS = 3, 2, 16, 3


def _batches():
    """One batch per dp replica, and the global batch they make together."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2 * BATCH, LENGTH), generator=g)
    return ids.split(BATCH), ids


def _model(checkpointing: bool):
    torch.manual_seed(0)
    model = llama(layers=LAYERS).double()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def _train(model, run, ids, full=lambda t: t, scale: float = 1.0):
    """(each step's gradients, the weights after the last step) by parameter name; the loss
    times ``scale``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for _ in range(STEPS):
        (run(input_ids=ids, labels=ids).loss * scale).backward()
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def ddp(over: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    group = mesh["dp"].get_group() if over == "dp" else None
    model = _model(checkpointing=False)
    run = DistributedDataParallel(ringify(model, ring_size=2, mesh=mesh["cp"]), process_group=group)
    return _train(model, run, _batches()[0][mesh["dp"].get_local_rank()])


@pytest.mark.parametrize("over", ["dp", "dp x cp"])
def test_ddp_trains_as_one_process_on_the_global_batch(ranks, over):
    model = _model(checkpointing=False)
    want_grads, want_weights = _train(model, model, _batches()[1])
    for grads, weights in ranks(4).run(ddp, over):
        for step, want in enumerate(want_grads):
            for name in want:
                torch.testing.assert_close(grads[step][name], want[name], rtol=1e-9, atol=1e-10)
        for name, want in want_weights.items():
            torch.testing.assert_close(weights[name], want, rtol=1e-9, atol=1e-10)


def _weight_copies(gm: torch.fx.GraphModule) -> Counter:
    """How many times each kind of weight crossing runs, in the graph and its regions."""
    from ringify.runtime.collectives.reduce import copy_averaged_outside, copy_to_ring

    kinds = {copy_to_ring: "reduced by the ring", copy_averaged_outside: "averaged outside"}
    return Counter(
        kinds[n.target]
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.target in kinds
    )


def per_layer_fsdp(over: str, root: str, checkpointing: bool):
    """What one rank trains; how its graph runs the units and reduces the weights' gradients;
    whether the blocks' parameters are sharded again between forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    shard_over = mesh["dp"] if over == "dp" else mesh["dp", "cp"]._flatten()
    model = _model(checkpointing)
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_over)
    if root == "model":
        ringified = ringify(fully_shard(model, mesh=shard_over), ring_size=2, mesh=mesh["cp"])
    else:
        ringified = fully_shard(ringify(model, ring_size=2, mesh=mesh["cp"]), mesh=shard_over)
    ids = _batches()[0][mesh["dp"].get_local_rank()]
    out = ringified(input_ids=ids, labels=ids)
    resharded = all(isinstance(p, DTensor) for p in model.model.layers.parameters())
    out.loss.backward()
    model.zero_grad()
    grads, weights = _train(model, ringified, ids, full=lambda t: t.full_tensor())
    report = ringified.report()
    copies = _weight_copies(ringified._active.module)
    return grads, weights, resharded, report.fsdp_units, report.checkpointed, copies


@pytest.mark.parametrize("over", ["dp", "dp x cp"])
@pytest.mark.parametrize("root", ["ringified", "model"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointed"])
def test_per_layer_fsdp2_trains_as_one_process_on_the_global_batch(
    ranks, over, root, checkpointing
):
    model = _model(checkpointing)
    want_grads, want_weights = _train(model, model, _batches()[1])
    layers = tuple(f"model.layers.{i}" for i in range(LAYERS))
    units = ("",) * (root == "model") + layers
    weights_used = sum(1 for _ in model.parameters())
    initial = dict(_model(False).named_parameters())
    results = ranks(4).run(per_layer_fsdp, over, root, checkpointing)
    for grads, weights, resharded, kept_units, kept_checkpoints, copies in results:
        assert resharded
        assert kept_units == units
        assert kept_checkpoints == (layers if checkpointing else ())
        # FSDP over dp x cp averages over the whole ring: the ring's own reduction is skipped
        kind = "averaged outside" if over == "dp x cp" else "reduced by the ring"
        assert copies == {kind: weights_used}, copies
        for step, want in enumerate(want_grads):
            for name in want:
                torch.testing.assert_close(grads[step][name], want[name], rtol=1e-9, atol=1e-10)
        for name, want in want_weights.items():
            assert not torch.equal(want, initial[name]), name  # it trained
            torch.testing.assert_close(weights[name], want, rtol=1e-9, atol=1e-10)


def grouped_units(recipe: str):
    """FSDP2 over dp x cp per layer, with a unit of several modules as torchtitan groups
    them: the final norm and the head, or the embedding, the norm and the head (a unit
    whose span holds the layers' units); "summed": every unit with divide factor 1 and the
    loss divided by the replicas, as torchtitan divides by its global token count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    shard_over = mesh["dp", "cp"]._flatten()
    model = _model(checkpointing=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_over)
    grouped = [model.model.norm, model.lm_head]
    if recipe != "norm and head":
        grouped.insert(0, model.model.embed_tokens)
    fully_shard(grouped, mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    scale = 1.0
    if recipe.endswith("summed"):
        for unit in [*model.model.layers, model.lm_head, model]:
            unit.set_gradient_divide_factor(1.0)
        scale = 1 / mesh["dp"].size()
    ringified = ringify(model, ring_size=2, mesh=mesh["cp"])
    ids = _batches()[0][mesh["dp"].get_local_rank()]
    grads, weights = _train(model, ringified, ids, lambda t: t.full_tensor(), scale)
    return grads, weights, ringified.report().fsdp_units


@pytest.mark.parametrize("recipe", ["norm and head", "embedding, norm and head, summed"])
def test_fsdp2_units_of_several_modules_train_as_one_process(ranks, recipe):
    model = _model(checkpointing=False)
    want_grads, want_weights = _train(model, model, _batches()[1])
    grouped = "[model.norm, lm_head]"
    if recipe != "norm and head":
        grouped = "[model.embed_tokens, model.norm, lm_head]"
    units = ("", *(f"model.layers.{i}" for i in range(LAYERS)), grouped)
    for grads, weights, kept_units in ranks(4).run(grouped_units, recipe):
        assert sorted(kept_units) == sorted(units), kept_units
        for step, want in enumerate(want_grads):
            for name in want:
                torch.testing.assert_close(grads[step][name], want[name], rtol=1e-9, atol=1e-10)
        for name, want in want_weights.items():
            torch.testing.assert_close(weights[name], want, rtol=1e-9, atol=1e-10)


def mixed_precision(wrong_scale: bool = False):
    """(per step, the largest relative difference of the ringified model's gradients from the
    unmodified model's under the same FSDP2 recipe, and its tolerance; the same for the
    weights after the steps; the dtypes the blocks' matmuls run in). ``wrong_scale``: the ring's gradients go to FSDP's average
    over dp x cp unscaled (x1 instead of x P), to show that the test can fail.

    The blocks compute in float32, whose rounding depends on the CPU's kernels, so the
    tolerance is measured: the unmodified model's own difference when each replica's batch
    rows come in the other order (the same sums, in another order), on this machine, as
    ``ringify.testing.tolerance`` does. Adam's steps amplify rounding: each step has its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ringify.testing.tolerance import FACTOR, relative_difference

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    ids = _batches()[0][mesh["dp"].get_local_rank()]
    runs = []
    for ring, batch in ((False, ids), (False, ids.flip(0)), (True, ids)):
        model = _model(checkpointing=True)
        shard_over = mesh["dp", "cp"]._flatten() if ring else mesh["dp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=shard_over, mp_policy=policy)
        run = ringify(model, ring_size=2, mesh=mesh["cp"]) if ring else model
        run = fully_shard(run, mesh=shard_over, mp_policy=policy)
        with _unscaled_for_fsdp() if ring and wrong_scale else contextlib.nullcontext():
            grads, weights = _train(model, run, batch, full=lambda t: t.full_tensor())
        runs.append([*grads, weights])
    want, reordered, got = runs

    def largest(a, b):
        return max(relative_difference(a[n], b[n]) for n in b)

    steps = [
        (largest(g, w), FACTOR * max(largest(r, w), torch.finfo(torch.float32).eps))
        for w, r, g in zip(want, reordered, got, strict=True)
    ]
    matmuls = {
        str(n.meta["val"].dtype)
        for m in run._active.module.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.target is torch.ops.aten.linear.default
    }
    return steps, matmuls


def _unscaled_for_fsdp():
    """A deliberate bug: weight gradients averaged outside the ring are not scaled by P."""
    from unittest import mock

    from ringify.runtime.collectives.reduce import _CopyToRing

    backward = _CopyToRing.backward

    def unscaled(ctx, grad):
        return (grad, None, None) if ctx.averaged_outside else backward(ctx, grad)

    return mock.patch.object(_CopyToRing, "backward", staticmethod(unscaled))


def test_per_layer_fsdp2_mixed_precision_runs_the_blocks_in_param_dtype(ranks):
    """A float64 model, all-gathered to float32: the ringified model trains as the unmodified
    model does under the same FSDP2 recipe, to float32 precision (each step's gradients; the
    weights after 3 AdamW steps), with every matmul in float32."""
    for steps, matmuls in ranks(4).run(mixed_precision):
        assert matmuls == {"torch.float32"}, matmuls
        assert all(difference <= tolerance for difference, tolerance in steps), steps


def test_a_wrong_fsdp_scale_fails_the_mixed_precision_comparison(ranks):
    """The measured tolerance keeps the test's power: gradients off by the ring's size fail."""
    for steps, _ in ranks(4).run(mixed_precision, True):
        assert all(difference > tolerance for difference, tolerance in steps), steps
