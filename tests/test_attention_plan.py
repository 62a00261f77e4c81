"""One plan per mask program per model call: the pass emits one ``attention_plan`` node, every
layer's ring op (forward and backward, eager or compiled, checkpointed or not) finds the plan by
its handle, and the program's inputs are copied to the host once per call."""

from __future__ import annotations

import pytest
import torch

LAYERS = 3


def _packed(seq: int, lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in (*lengths, seq - sum(lengths))]).expand(2, -1)


def plan_per_step(backend: str | None, checkpointing: bool, first: int):
    """(attention_plan nodes, ring ops reading them, the plan lookups of a step whose mask the
    last step had, those of a step with another packing, its gradients' largest difference
    from the unmodified model's over their tolerance)."""
    import torch.distributed as dist

    from ringify import ringify
    from ringify.runtime.masks.plan import plan_lookups, reset_plan_lookups
    from ringify.testing import hf_models

    torch.manual_seed(0)
    seq = 16 * dist.get_world_size()
    model = hf_models.llama(layers=LAYERS, max_len=4 * seq).double()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ringified = ringify(model, ring_size=dist.get_world_size())
    run = ringified if backend is None else torch.compile(ringified, backend=backend)
    ids = torch.randint(1, 64, (2, seq), generator=torch.Generator().manual_seed(0))

    def step(lengths):
        model.zero_grad(set_to_none=True)
        out = run(input_ids=ids, labels=ids, position_ids=_packed(seq, lengths))
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # packings no earlier job of this rank process used (its plans are kept by content)
    step((first, 9))
    reset_plan_lookups()
    step((first, 9))
    same = plan_lookups()
    reset_plan_lookups()
    _, grads = step((first, 12))
    other = plan_lookups()

    def unmodified(run):
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids, position_ids=_packed(seq, (first, 12))).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def largest(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in b)

    want = unmodified(model)
    tolerance = 1e-10
    if backend == "inductor":  # HF's float32 loss fused otherwise: measured (see test_ringify)
        from ringify.testing.tolerance import FACTOR

        tolerance = max(tolerance, FACTOR * largest(unmodified(torch.compile(model)), want))
    error = largest(grads, want) / tolerance
    graph = next(iter(ringified._traced.values())).module
    nodes = [
        n for m in graph.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
    ]
    plans = [n for n in nodes if n.target is torch.ops.ringify.attention_plan.default]
    rings = [n for n in nodes if n.target is torch.ops.ringify.ring_attention.default]
    reading = sum(1 for n in rings if n.args[-1] in plans or _is_region_input(n.args[-1]))
    return len(plans), (len(rings), reading), same, other, error


def _is_region_input(arg) -> bool:
    """A plan handle handed into a checkpointed or FSDP region arrives as its placeholder."""
    return isinstance(arg, torch.fx.Node) and arg.op == "placeholder"


@pytest.mark.parametrize(
    ("backend", "checkpointing", "first"),
    [(None, False, 1), (None, True, 2), ("aot_eager", False, 3), ("inductor", False, 4)],
    ids=["eager", "checkpointed", "aot_eager", "inductor"],
)
def test_one_plan_per_step_whatever_the_layers(ranks, backend, checkpointing, first):
    calls = 2 * LAYERS + LAYERS * checkpointing  # forward, backward, a checkpoint's recompute
    for plans, (rings, reading), same, other, error in ranks(2).run(
        plan_per_step, backend, checkpointing, first
    ):
        assert plans == 1 and rings == reading == LAYERS
        assert same == {"by handle": calls, "host copies": 1, "built": 0}, same
        assert other == {"by handle": calls, "host copies": 1, "built": 1}, other
        assert error <= 1.0  # relative to the tolerance


def test_a_handles_entry_lives_as_long_as_the_handle():
    """Plans and kept masks are found by the handle tensor itself: its entry goes when the
    graph frees it, and a later tensor that happens to get its id finds nothing."""
    import gc

    from ringify.runtime.masks.handles import HandleMap

    kept, handle = HandleMap(), torch.tensor([1])
    kept[handle] = "plan"
    assert kept.get(handle) == "plan" and kept.get(torch.tensor([1])) is None
    old_id = id(handle)
    del handle
    gc.collect()
    assert len(kept) == 0
    later = [torch.tensor([1]) for _ in range(64)]  # some may take the old id: none is found
    assert all(kept.get(t) is None for t in later), old_id
