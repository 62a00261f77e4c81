"""Hooks on the ringified module see the model's call: what the user passed and what the model
returned, on every rank, whether registered before the first call (which traces) or after it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringify import ringify
from ringify.testing.models import NanoGPT

KINDS = ("pre", "pre with kwargs", "forward", "forward with kwargs", "always_call")
KINDS += ("global pre", "global forward")


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))


def _register(module: nn.Module, kind: str, seen: list, others: list):
    """A hook of ``kind`` that records what it saw of ``module``'s calls, and the names of
    other modules it saw called (a global hook sees every module's calls)."""

    def pre(m, args, kwargs=None):
        if m is not module:
            others.append(type(m).__name__)
            return
        seen.append(("in", [a.clone() for a in args], dict(kwargs or {})))

    def forward(m, args, *rest):
        if m is not module:
            others.append(type(m).__name__)
            return
        output = rest[-1]
        seen.append(("out", [a.clone() for a in args], output[0].detach().clone()))

    if kind == "pre":
        return module.register_forward_pre_hook(pre)
    if kind == "pre with kwargs":
        return module.register_forward_pre_hook(pre, with_kwargs=True)
    if kind == "forward":
        return module.register_forward_hook(forward)
    if kind == "forward with kwargs":
        return module.register_forward_hook(forward, with_kwargs=True)
    if kind == "always_call":
        return module.register_forward_hook(forward, always_call=True)
    if kind == "global pre":
        return nn.modules.module.register_module_forward_pre_hook(pre)
    return nn.modules.module.register_module_forward_hook(forward)


def hooks_see_the_call(kind: str, when: str):
    """Two calls (the first traces); the hook registered before the first or after it. Returns
    what it saw of the ringified module's calls, the other modules it saw called in the second
    call, and what the unmodified model gives for the calls it saw."""
    torch.manual_seed(0)
    model = NanoGPT().double()
    ringified = ringify(model, ring_size=dist.get_world_size())
    seen, others = [], []
    handle = _register(ringified, kind, seen, others) if when == "before" else None
    ringified(*_batch(0))
    if handle is None:
        handle = _register(ringified, kind, seen, others)
    others.clear()  # tracing calls the model's modules (on fake tensors): the first call only
    ringified(*_batch(1))
    handle.remove()
    calls = (0, 1) if when == "before" else (1,)
    return seen, others, [(list(_batch(s)), model(*_batch(s))[0].detach()) for s in calls]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_hook_on_the_ringified_module_sees_the_models_call(ranks, kind, when):
    for seen, others, calls in ranks(2).run(hooks_see_the_call, kind, when):
        assert others == []  # no module of ringify's own is called where hooks see it
        assert len(seen) == len(calls), seen
        for (what, args, extra), (inputs, logits) in zip(seen, calls, strict=True):
            assert len(args) == 2
            for got, want in zip(args, inputs, strict=True):
                assert torch.equal(got, want)
            if what == "in":
                assert extra == {}
            else:
                torch.testing.assert_close(extra, logits, rtol=0, atol=1e-12)


def a_pre_hook_that_reads_kwargs(world: int):
    """HF-style keyword call: a pre-hook with kwargs reads ``input_ids`` (as a Trainer callback
    that logs each rank's batch does)."""
    from ringify.testing.hf_models import llama

    torch.manual_seed(0)
    model = llama().double()
    ringified = ringify(model, ring_size=world)
    logged = []
    ringified.register_forward_pre_hook(
        lambda m, args, kwargs: logged.append(kwargs["input_ids"].detach().clone()),
        with_kwargs=True,
    )
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ringified(input_ids=ids, labels=ids).loss.backward()
    return logged, ids


def test_a_pre_hook_reads_the_keyword_inputs(ranks):
    for logged, ids in ranks(2).run(a_pre_hook_that_reads_kwargs, 2):
        assert len(logged) == 1 and torch.equal(logged[0], ids)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def observing_hooks(compiled: bool):
    """Hooks that only observe, on the model's modules: a forward hook storing blocks[0]'s
    output, a pre-hook storing blocks[1]'s input, and one logging a statistic with .item().
    Three calls; what each saw of real tensors, and this rank's shards of what the unmodified
    model's modules computed."""
    from ringify.runtime import shard

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = NanoGPT().double()
    seen = {"output": [], "input": [], "norm": []}
    model.blocks[0].register_forward_hook(lambda m, a, o: seen["output"].append(o.detach()))
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen["input"].append(a[0].detach()))
    model.ln_f.register_forward_hook(lambda m, a, o: seen["norm"].append(o.norm().item()))
    ringified = ringify(model, ring_size=world)
    run = torch.compile(ringified, backend="aot_eager") if compiled else ringified
    for seed in range(3):
        run(*_batch(seed))[1].backward()
    # each hook also ran once while tracing, on fake tensors (its .item() then a SymFloat)
    got = {k: [x for x in v if type(x) in (float, torch.Tensor)] for k, v in seen.items()}
    twin = NanoGPT().double()
    twin.load_state_dict(model.state_dict())
    full = {"output": [], "input": []}
    twin.blocks[0].register_forward_hook(lambda m, a, o: full["output"].append(o.detach()))
    twin.blocks[1].register_forward_pre_hook(lambda m, a: full["input"].append(a[0].detach()))
    for seed in range(3):
        twin(*_batch(seed))
    want = {k: [shard(t, 1, layout="zigzag") for t in v] for k, v in full.items()}
    return got, want, ringified.traces


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_observing_hooks_on_modules_run_at_every_call_on_the_shard(ranks, compiled):
    for got, want, traces in ranks(2).run(observing_hooks, compiled):
        assert traces == 1
        assert len(got["norm"]) == 3 and all(isinstance(x, float) for x in got["norm"])
        for kind in ("output", "input"):
            assert len(got[kind]) == 3, (kind, len(got[kind]))
            for g, w in zip(got[kind], want[kind], strict=True):
                assert g.shape == w.shape  # this rank's shard, not the whole sequence
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def a_hook_that_changes_its_mind():
    """Returns nothing on fake tensors (while tracing), a value on real ones: refused."""
    from ringify.testing import outcome

    def hook(m, a, o):
        return None if _is_fake(o) else o * 2

    torch.manual_seed(0)
    model = NanoGPT().double()
    model.blocks[0].register_forward_hook(hook)
    return outcome(lambda: ringify(model, ring_size=dist.get_world_size())(*_batch(0)))


def test_an_observer_that_returns_a_value_at_run_time_is_refused_on_every_rank(ranks):
    for kind, message, _ in ranks(2).run(a_hook_that_changes_its_mind):
        assert kind == "RuntimeError" and "returned a value at run time" in message, message
