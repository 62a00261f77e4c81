"""The ringified module over a model's life: new weights, dtype moves, hooks, checkpoints, caching."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringify import ringify
from ringify.module import TRACE_CACHE_SIZE
from ringify.testing.models import NanoGPT
from ringify.testing.tolerance import exceeding


def _batch(seed=0, seq=16, batch=2):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 64, (batch, seq), generator=g) for _ in range(2))


def _model(seed=0):
    torch.manual_seed(seed)
    return NanoGPT().double()


def _results(run, model, idx, targets) -> dict[str, torch.Tensor]:
    """The logits and every parameter's gradient (None if it got none) of one step."""
    model.zero_grad(set_to_none=True)
    logits, loss = run(idx, targets)
    loss.backward()
    return {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def new_weights_after_the_first_call():
    """load_state_dict(assign=True), a swapped parameter and model.to() after the first call:
    the ringified model computes with, and gives gradients to, the model's current tensors."""
    import torch.distributed as dist

    from ringify.testing.tolerance import differences, reordering_tolerances

    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _model()
    ringified = ringify(model, ring_size=world)
    ringified(*_batch())[1].backward()
    model.load_state_dict(_model(seed=1).state_dict(), assign=True)
    model.ln_f.weight = nn.Parameter(torch.rand_like(model.ln_f.weight))
    results = {}
    for dtype in (torch.float64, torch.float32):
        model.to(dtype)
        got = _results(ringified, model, *_batch(1))
        want = _results(model, model, *_batch(1))
        # float32 rounding depends on the CPU: the unmodified model's own difference with
        # its batch rows swapped sets the bound (ringify.testing.tolerance)
        swapped = _results(model, model, *(x.flip(0) for x in _batch(1)))
        swapped["logits"] = swapped["logits"].flip(0)
        missing = [n for n, g in got.items() if g is None]
        results[str(dtype)] = {
            "dtype": got["logits"].dtype == dtype,
            "missing grads": missing,
            "differences": {} if missing else differences(got, want),
            "tolerances": reordering_tolerances(want, swapped),
        }
    results["graph holds no parameter"] = not any(
        True for t in ringified._traced.values() for _ in t.module.parameters()
    )
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_new_weights_after_the_first_call_are_used(ranks, world):
    per_rank = (
        [new_weights_after_the_first_call()]
        if world == 1
        else ranks(world).run(new_weights_after_the_first_call)
    )
    for r in per_rank:
        assert r.pop("graph holds no parameter")
        for dtype in ("torch.float64", "torch.float32"):
            result = r[dtype]
            assert result["dtype"] and result["missing grads"] == [], r
            assert exceeding(result["differences"], result["tolerances"]) == {}, r


class AttentionThenBatchNorm(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v).squeeze(1)
        return self.norm(y.transpose(1, 2))


def test_buffers_the_model_updates_are_updated_in_the_model():
    """BatchNorm's running statistics live in the model, not in a copy held by the graph."""
    torch.manual_seed(0)
    model, twin = AttentionThenBatchNorm().double(), AttentionThenBatchNorm().double()
    twin.load_state_dict(model.state_dict())
    ringified = ringify(model, ring_size=1)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 8, 8, dtype=torch.float64, generator=g)
        torch.testing.assert_close(ringified(x), twin(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(model.norm.running_var, twin.norm.running_var, rtol=0, atol=1e-12)
    assert model.norm.num_batches_tracked.item() == 3


def test_a_hook_that_changes_an_output_is_in_the_graph_and_one_added_later_takes_effect():
    """(Hooks that only observe: tests/test_hooks.py.)"""
    model = _model()
    model.blocks[0].register_forward_hook(lambda m, i, o: o * 2)
    ringified = ringify(model, ring_size=1)
    got = ringified(*_batch())
    torch.testing.assert_close(got[0], model(*_batch())[0], rtol=0, atol=1e-12)
    handle = model.blocks[1].register_forward_hook(lambda m, i, o: o + 1)  # after the first call
    torch.testing.assert_close(ringified(*_batch())[0], model(*_batch())[0], rtol=0, atol=1e-12)
    handle.remove()
    torch.testing.assert_close(ringified(*_batch())[0], model(*_batch())[0], rtol=0, atol=1e-12)
    assert len(ringified._traced) == 2  # with and without the later hook


def test_a_module_backward_hook_is_refused_not_skipped():
    """A module's backward hook would never run (the graph computes the backward): refused,
    on the first call and when added after one (which traces again)."""
    model = _model()
    handle = model.blocks[0].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(ValueError, match=r"blocks\.0 have backward hooks"):
        ringify(model, ring_size=1)(*_batch())
    handle.remove()
    ringified = ringify(model, ring_size=1)
    ringified(*_batch())
    model.blocks[1].register_full_backward_pre_hook(lambda m, go: None)
    with pytest.raises(ValueError, match=r"p\.register_hook"):
        ringified(*_batch())


def test_state_dict_keys_are_the_models_both_ways():
    model, other = _model(), _model(seed=1)
    ringified = ringify(model, ring_size=1)
    ringified(*_batch())
    saved = ringified.state_dict()
    assert list(saved) == list(model.state_dict())
    assert [n for n, _ in ringified.named_parameters()] == [n for n, _ in model.named_parameters()]
    other.load_state_dict(saved)  # strict: the ringified checkpoint loads into the model
    ringified.load_state_dict(_model(seed=2).state_dict())  # and the model's into it
    torch.testing.assert_close(model.wte.weight, _model(seed=2).wte.weight, rtol=0, atol=0)
    held = model.state_dict(keep_vars=True)
    for key in saved:  # each key is an attribute path through the ringified module (DCP)
        owner, _, name = key.rpartition(".")
        assert getattr(ringified.get_submodule(owner), name) is held[key], key
    parent = nn.ModuleDict({"lm": ringified})
    assert list(parent.state_dict()) == ["lm." + k for k in model.state_dict()]
    parent.load_state_dict(parent.state_dict())


def test_trace_cache_is_bounded():
    """Signatures that differ otherwise than in their length (the batch size here; lengths
    share one graph, ``tests/test_lengths.py``) are kept per signature, the last 8."""
    ringified = ringify(_model(), ring_size=1)
    for batch in range(1, 1 + TRACE_CACHE_SIZE + 4):
        ringified(*_batch(seq=8, batch=batch))
    assert len(ringified._traced) == TRACE_CACHE_SIZE
    batches = [key[1][0][0][0] for key in ringified._traced]
    assert batches == list(range(5, 5 + TRACE_CACHE_SIZE))  # the least recently used went first


def test_the_models_attributes_are_read_through_the_wrapper():
    """Code written for the model (HF Trainer sets ``model.config.use_cache``, reads
    ``loss_type`` and ``main_input_name``) finds the model's attributes; ringify's own
    configuration is ``ringify_config``; the wrapper's own attributes are its own."""
    from ringify.testing.hf_models import llama

    model = llama()
    ringified = ringify(model, ring_size=1)
    assert ringified.config is model.config
    assert ringified.loss_type == model.loss_type
    assert ringified.main_input_name == "input_ids"
    assert ringified.ringify_config.ring_size == 1 and ringified.model is model.model
    assert dict(ringified.named_parameters()) == dict(model.named_parameters())
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = ringified.no_such_attribute
