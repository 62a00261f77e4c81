"""One plan per mask program per step: the pass emits one ``attention_plan`` node, every
layer's ring op (forward and backward, eager or compiled, checkpointed or not) takes the plan
it makes as an argument, and the program's inputs are copied to the host once per step. A plan
is a value: it prints what it decided, and is tested here without a ring of ranks."""

from __future__ import annotations

import pytest
import torch

LAYERS = 3


def _packed(seq: int, lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in (*lengths, seq - sum(lengths))]).expand(2, -1)


def plan_per_step(backend: str | None, checkpointing: bool, first: int):
    """(attention_plan nodes, ring ops reading them, the plans made in a step whose mask the
    last step had, those of a step with another packing, its gradients' largest difference
    from the unmodified model's over their tolerance). Plans made: (by the graph, by the ring
    calls themselves, the ring calls on the graph's plans)."""
    import torch.distributed as dist
    from plans_made import made_plans

    from ringify import ringify
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

    def counted(lengths):
        with made_plans() as made:
            result = step(lengths)
        counts = (len(made.by_graph), len(made.by_calls), made.calls())
        return result, counts, made.by_graph[0].masks

    _, _, before = counted((first, 9))
    _, same, again = counted((first, 9))
    (_, grads), other, anew = counted((first, 12))
    # a new plan every step, around the host-side answers of the same mask (memoised by
    # content: nothing decided again), or of another packing (decided anew)
    reused = (again is before, anew is before)

    def unmodified(run):
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids, position_ids=_packed(seq, (first, 12))).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def largest(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in b)

    want = unmodified(model)
    error = largest(grads, want) / 1e-10
    graph = next(iter(ringified._traced.values())).module
    nodes = [
        n for m in graph.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
    ]
    plans = [n for n in nodes if n.target is torch.ops.ringify.attention_plan.default]
    rings = [n for n in nodes if n.target is torch.ops.ringify.ring_attention.default]
    given = [n.args[7] for n in rings]  # the ring op's plan (``protocol.FORWARD``)
    reading = sum(1 for plan in given if plan in plans or _is_region_input(plan))
    return len(plans), (len(rings), reading), same, other, reused, error


def _is_region_input(arg) -> bool:
    """A plan handed into a checkpointed or FSDP region arrives as its placeholder."""
    return isinstance(arg, torch.fx.Node) and arg.op == "placeholder"


@pytest.mark.parametrize(
    ("backend", "checkpointing", "first"),
    [(None, False, 1), (None, True, 2), ("aot_eager", False, 3)],  # Inductor: test_ringify's
    ids=["eager", "checkpointed", "aot_eager"],
)
def test_one_plan_per_step_whatever_the_layers(ranks, backend, checkpointing, first):
    calls = 2 * LAYERS + LAYERS * checkpointing  # forward, backward, a checkpoint's recompute
    for plans, (rings, reading), same, other, reused, error in ranks(2).run(
        plan_per_step, backend, checkpointing, first
    ):
        assert plans == 1 and rings == reading == LAYERS
        assert same == other == (1, 0, calls), (same, other)
        assert reused == (True, False)
        assert error <= 1.0  # relative to the tolerance


def test_a_plan_is_a_value_that_says_what_it_decided():
    """Made without a ring of ranks (a ring of 4 as a value): a sliding window of 8 over
    chunks of 16 (two tiles of 8) sends each rank's last tile one step on (the last rank's,
    seen by no one further, not at all); an unmasked ring sends every rank's keys round it; the two print so."""
    from ringify.runtime.collectives.ring import Ring
    from ringify.runtime.masks.call_plan import CallGeometry, plan_for
    from ringify.testing.ring_vs_sdpa import window_program

    window_of_8 = window_program(8)
    ring = Ring(None, 0, 4)
    geometry = CallGeometry(ring.name, 4, 16, False, "contiguous", 64, 2)
    window = plan_for(ring, geometry, None, window_of_8, [])
    dense = plan_for(ring, geometry, None, "", [])
    assert window.summary()["K/V rows sent"] == [8, 8, 8, 0]
    assert dense.summary()["K/V rows sent"] == [48, 48, 48, 48]
    assert dense.summary()["tile pairs"] == dense.summary()["dense tile pairs"] == [16] * 4
    # a window of 8 over tiles of 8: a tile sees itself and the one before it (not the first)
    assert window.summary()["tile pairs"] == [3, 4, 4, 4]
    assert "sparsity=0.00" in repr(dense) and "sparsity=0.77" in repr(window)
    assert window.balanced is not None and repr(window).startswith("RingPlan(ring=4")


def replayed_plans():
    """A step recorded into a CUDA graph (its ring calls told they are being captured: this
    CPU has no graphs), then a step with the same packing and one with another. Returns (the
    plan node's cudagraph_unsafe tag, the ring node's, by Inductor's own test; the same
    packing's largest gradient difference from the unmodified model's, recorded and not; the
    other's error)."""
    from unittest import mock

    import torch.distributed as dist
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    from ringify import ringify
    from ringify.runtime.masks import captures
    from ringify.testing import hf_models

    torch.manual_seed(0)
    seq = 16 * dist.get_world_size()
    model = hf_models.llama(layers=2, max_len=4 * seq).double()
    ringified = ringify(model, ring_size=dist.get_world_size())
    ids = torch.randint(1, 64, (2, seq), generator=torch.Generator().manual_seed(0))

    def step(run, lengths):
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids, position_ids=_packed(seq, lengths)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with mock.patch.dict(captures._captured, clear=True):
        step(ringified, (3, 9))  # a warm-up step, as a CUDA graph tree's
        with mock.patch("ringify.runtime.attention.ops.capturing", lambda device: True):
            recorded = step(ringified, (3, 9))
        got, want = step(ringified, (3, 9)), step(model, (3, 9))
        same = max((g[n] - want[n]).abs().max().item() for g in (recorded, got) for n in want)
        try:
            step(ringified, (3, 12))
            error = None
        except RuntimeError as e:
            error = str(e)
    graph = next(iter(ringified._traced.values())).module
    nodes = list(graph.graph.nodes)
    plans = [n for n in nodes if n.target is torch.ops.ringify.attention_plan.default]
    rings = [n for n in nodes if n.target is torch.ops.ringify.ring_attention.default]
    unsafe = (
        [is_cudagraph_unsafe_fx_node(n) for n in plans],
        {is_cudagraph_unsafe_fx_node(n) for n in rings},
    )
    return unsafe, same, error


def test_a_cuda_graph_replays_its_plan_only_for_the_mask_it_recorded(ranks):
    """A CUDA graph replays the ring calls it recorded with their plan, running no Python:
    Inductor runs the plan op outside the graphs (tagged cudagraph_unsafe), and a later step
    whose mask has other content raises on every rank, naming the fix; the same mask runs
    exactly."""
    for (plans, rings), same, error in ranks(2).run(replayed_plans):
        assert plans == [True] and rings == {False}
        assert same <= 1e-10
        assert error is not None and "differs from the one a CUDA graph recorded" in error
        assert "max-autotune-no-cudagraphs" in error


def test_a_plan_that_reads_its_inputs_is_not_made_inside_a_cuda_graph():
    """Made while a CUDA graph records (a ring op given no plan, its program's inputs on the
    device), a plan would read them on the host: it raises, naming the plan op."""
    from unittest import mock

    from ringify.runtime.collectives.ring import Ring
    from ringify.runtime.masks import call_plan as plan_module
    from ringify.runtime.masks import captures
    from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs

    ring, inputs = Ring(None, 0, 2), document_inputs([20, 12])
    geometry = plan_module.CallGeometry(ring.name, 2, 16, True, "contiguous", 32, 2)
    args = (ring, geometry, None, document_causal_program(), inputs)
    assert plan_module.plan_for(*args).key is not None
    with (
        mock.patch.object(captures, "capturing", lambda device: True),
        pytest.raises(RuntimeError, match=r"torch\.ops\.ringify\.attention_plan"),
    ):
        plan_module.plan_for(*args)


def test_two_masks_of_one_site_are_not_recorded():
    """Two plans of one site (program and geometry) with other inputs, recorded (two
    attentions of a step): refused, since a later step could bring each the other's mask;
    recording one plan's again is not."""
    from unittest import mock

    from ringify.runtime.collectives.ring import Ring
    from ringify.runtime.masks import call_plan as plan_module
    from ringify.runtime.masks import captures
    from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs

    ring, program = Ring(None, 0, 2), document_causal_program()

    def plan(lengths):
        geometry = plan_module.CallGeometry(ring.name, 2, 16, True, "contiguous", 32, 2)
        return plan_module.plan_for(ring, geometry, None, program, document_inputs(lengths))

    with mock.patch.dict(captures._captured, clear=True):
        first, second = plan([20, 12]), plan([10, 22])
        captures.note_captured(first.key)
        captures.note_captured(first.key)
        with pytest.raises(RuntimeError, match="cannot tell which mask a step brings"):
            captures.note_captured(second.key)
