"""Activation checkpointing is kept: each checkpointed module's span of the rewritten graph
runs under a non-reentrant checkpoint (the ring op recomputed in the backward). Exact against
the unmodified model, and autograd saves as much less as it does for the unmodified model.
Forms that cannot be kept are refused on every rank, naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from ringify import ringify
from ringify.runtime.region_runs import Checkpointed
from ringify.testing import outcome, saved_for_backward_bytes
from ringify.testing.hf_models import llama


class _Block(torch.nn.Module):
    def __init__(self, checkpoints_itself: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)
        self.checkpoints_itself = checkpoints_itself  # as HF's layers do

    def forward(self, x):
        if self.checkpoints_itself:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(x.shape)).relu()


class _Model(torch.nn.Module):
    """Two blocks, run through ``checkpoint`` in one of several forms."""

    def __init__(self, form: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(form == "itself"), _Block(form == "itself")])
        self.form = form

    def forward(self, x):
        for block in self.blocks:
            if self.form == "module":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.form == "method":  # from outside the block: not on the block's nodes
                x = checkpoint(block.forward, x, use_reentrant=False)
            elif self.form == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif self.form == "function":
                x = checkpoint(lambda y, b=block: b(y) * 2, x, use_reentrant=False)
            else:
                x = block(x)
        return x.square().mean()


def _grads(model, step):
    model.zero_grad(set_to_none=True)
    loss = step()
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("form", ["module", "itself"])
def test_a_checkpointed_module_is_kept_and_exact(form):
    torch.manual_seed(0)
    model = _Model(form).double()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    ringified = ringify(model, ring_size=1)
    want = _grads(model, lambda: model(x))
    got = _grads(model, lambda: ringified(x))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ringified.report().checkpointed == ("blocks.0", "blocks.1")
    regions = [m for m in ringified._last().module.modules() if isinstance(m, Checkpointed)]
    assert len(regions) == 2
    assert all(
        any(n.target is torch.ops.ringify.ring_attention.default for n in r.region.graph.nodes)
        for r in regions
    )


@pytest.mark.parametrize(
    "form, fix",
    [
        ("reentrant", "use_reentrant=False"),
        ("function", "Checkpoint a module"),
        ("method", "Checkpoint a module"),
    ],
)
def test_a_checkpoint_that_cannot_be_kept_is_refused(form, fix):
    x = torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match=fix):
        ringify(_Model(form), ring_size=1)(x)


def test_a_no_grad_attention_is_refused():
    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _Block()

        def forward(self, x):
            with torch.no_grad():
                x = self.block(x)
            return self.block(x)

    with pytest.raises(ValueError, match="switches gradients off"):
        ringify(NoGrad(), ring_size=1)(torch.randn(2, 16, 8))


def hf_checkpointing(ring_size: int, compiled: bool):
    """(largest difference from the unmodified model, checkpointed modules, saved-for-backward
    bytes of the unmodified model and of the ringified one, each without and with checkpoints)."""
    torch.manual_seed(0)
    model = llama(layers=3).double()
    ids = torch.randint(1, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    ringified = ringify(model, ring_size=ring_size)
    run = torch.compile(ringified, backend="aot_eager") if compiled else ringified
    saved, results = {}, {}
    for checkpointed in (False, True):
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        for name, fn in (("model", model), ("ringified", run)):
            model.zero_grad(set_to_none=True)
            nbytes, out = saved_for_backward_bytes(
                lambda f=fn: f(input_ids=ids, labels=ids), leave_out=params
            )
            out.loss.backward()
            saved[name, checkpointed] = nbytes
            results[name, checkpointed] = [out.logits.detach(), *(p.grad for p in params)]
    want = results["model", False]
    err = max(
        (a - b).abs().max().item()
        for key in (("model", True), ("ringified", False), ("ringified", True))
        for a, b in zip(results[key], want, strict=True)
    )
    return err, ringified.report().checkpointed, saved


@pytest.mark.parametrize("ring_size, compiled", [(2, False), (4, False), (2, True)])
def test_hf_gradient_checkpointing_is_kept_on_the_ring(ranks, ring_size, compiled):
    for err, checkpointed, saved in ranks(ring_size).run(hf_checkpointing, ring_size, compiled):
        assert err <= 1e-10, err
        assert checkpointed == ("model.layers.0", "model.layers.1", "model.layers.2")
        model_cut = saved["model", True] / saved["model", False]
        ring_cut = saved["ringified", True] / saved["ringified", False]
        assert model_cut < 0.5, saved
        assert ring_cut <= 1.25 * model_cut, saved


def hf_checkpointing_option(option: dict):
    """(largest difference from the unmodified model, checkpointed modules) of a 4-layer
    Llama under transformers' ``activation_checkpointing_enable`` with ``option``."""
    torch.manual_seed(0)
    model = llama(layers=4).double()
    ids = torch.randint(1, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            model.activation_checkpointing_enable({"use_reentrant": False}, **option)
        fn = ringify(model, ring_size=2) if checkpointed else model
        model.zero_grad(set_to_none=True)
        out = fn(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits.detach(), *(p.grad for p in params)])
    err = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    return err, fn.report().checkpointed


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "activation_checkpointing_enable"),
    reason="transformers before 5.24: no activation_checkpointing_enable",
)
@pytest.mark.parametrize(
    "option, layers",
    [({"every_n_layers": 2}, (0, 2)), ({"offload": True}, (0, 1, 2, 3))],
    ids=["every_2_layers", "offload"],
)
def test_hf_activation_checkpointing_options_are_kept(ranks, option, layers):
    """transformers 5.24's options: checkpoints on every n-th layer only, and the saved
    activations offloaded (``save_on_cpu``) around each checkpoint."""
    for err, checkpointed in ranks(2).run(hf_checkpointing_option, option):
        assert err <= 1e-10, err
        assert checkpointed == tuple(f"model.layers.{i}" for i in layers)


def hf_reentrant():
    torch.manual_seed(0)
    model = llama()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return outcome(lambda: ringify(model, ring_size=2)(input_ids=ids, labels=ids))


def test_hf_reentrant_checkpointing_is_refused_on_every_rank(ranks):
    for kind, message, _ in ranks(2).run(hf_reentrant):
        assert kind == "ValueError" and "'use_reentrant': False" in message, message
