"""Dilated (LongNet) attention: the pattern, the reference, and the ring version against it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ring_attention import EXACT, assert_matches, assert_near_truth, make_inputs

from ringify.passes.graph.report import MaskKind
from ringify.runtime import Dilation, dilated_attention, ring_attention, shard
from ringify.runtime.collectives.layout import unshard
from ringify.testing.runs import inductor_control
from ringify.testing.tolerance import inductor_bound


@pytest.mark.parametrize(
    ("segments", "rates", "match"),
    [
        ((8, 16), (1,), "one dilation rate per segment length"),
        ((), (), "at least one pair"),
        ((8,), (0,), "positive"),
        ((12,), (8,), "does not divide segment length 12"),
    ],
)
def test_bad_dilation(segments, rates, match):
    with pytest.raises(ValueError, match=match):
        Dilation(segments, rates)


def reference(q, k, v, dout, dilation, is_causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = dilated_attention(q, k, v, dilation=dilation, is_causal=is_causal)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_pair_is_sdpa(is_causal):
    q, k, v, dout = make_inputs(2, 4, 4, 24, 8, torch.float64)
    got = reference(q, k, v, dout, Dilation((24,), (1,)), is_causal)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    out.backward(dout)
    assert_matches(got, [out.detach(), q.grad, k.grad, v.grad], 1e-12)


def test_reference_follows_the_definition():
    """One pair (4, 2), by hand: head h keeps offsets h % 2 of each 4-token segment."""
    q, k, v, _ = make_inputs(1, 3, 3, 8, 4, torch.float64)
    out = dilated_attention(q, k, v, dilation=Dilation((4,), (2,)))
    for h in range(3):
        for start in (0, 4):
            kept = [start + h % 2, start + h % 2 + 2]
            want = F.scaled_dot_product_attention(q[:, h, kept], k[:, h, kept], v[:, h, kept])
            torch.testing.assert_close(out[:, h, kept], want, rtol=0, atol=1e-12)
        dropped = [i for i in range(8) if i % 2 != h % 2]
        assert out[:, h, dropped].abs().max() == 0  # a row no pair keeps is zero


def ring_dilated(q, k, v, dout, dilation, is_causal):
    q, k, v, dout = (
        shard(t, 2, layout="contiguous").detach().clone().requires_grad_(t is not dout)
        for t in (q, k, v, dout)
    )
    out = ring_attention(
        q, k, v, dilation=dilation, is_causal=is_causal, enable_gqa=True, layout="contiguous"
    )
    out.backward(dout)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


# At 4 ranks (8 rows each): segments of 4 and 8 fit a chunk, 16 spans 2 ranks, 32 all 4.
PATTERNS = {
    "in-chunk": Dilation((4, 8), (1, 2)),
    "spanning": Dilation((4, 8, 16, 32), (1, 2, 2, 4)),
    "dense": Dilation((32,), (1,)),
}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_ring_matches_reference(ranks, world, pattern, is_causal, dtype):
    """6 heads (more than the largest rate, 4), GQA with 2 kv heads."""
    inputs = make_inputs(2, 6, 2, 32, 8, dtype)
    dilation = PATTERNS[pattern]
    if world == 1:
        per_rank = [ring_dilated(*inputs, dilation, is_causal)]
    else:
        per_rank = ranks(world).run(ring_dilated, *inputs, dilation, is_causal)
    got = [unshard([r[i] for r in per_rank], 2, "contiguous") for i in range(4)]
    want = gqa_reference(*inputs, dilation, is_causal)
    if dtype == torch.float64:
        assert_matches(got, want)
    else:  # the unmodified computation's own float32 error from a float64 truth, measured here
        truth = gqa_reference(*(t.double() for t in inputs), dilation, is_causal)
        assert_near_truth(got, want, truth)
    if pattern == "dense" and dtype == torch.float64:
        dense = F.scaled_dot_product_attention(*inputs[:3], is_causal=is_causal, enable_gqa=True)
        assert (got[0] - dense).abs().max().item() <= EXACT


def gqa_reference(q, k, v, dout, dilation, is_causal):
    """``reference`` with the kv heads repeated for it, their gradients summed back."""
    k, v = (x.repeat_interleave(3, dim=1) for x in (k, v))
    want = reference(q, k, v, dout, dilation, is_causal)
    want[2:] = [g.unflatten(1, (2, 3)).sum(2) for g in want[2:]]
    return want


def bad_ring_call(seq, dilation, layout):
    q, k, v, _ = make_inputs(1, 2, 2, seq, 4, torch.float32)
    ring_attention(
        *(shard(t, 2, layout=layout) for t in (q, k, v)), dilation=dilation, layout=layout
    )


@pytest.mark.parametrize(
    ("seq", "dilation", "layout", "match"),
    [
        (16, Dilation((8,), (1,)), "zigzag", "layout='contiguous'"),
        (24, Dilation((16,), (2,)), "contiguous", "must divide it"),
        (24, Dilation((8,), (1,)), "contiguous", "does not divide the 12 rows"),
        (16, Dilation((16,), (16,)), "contiguous", "rate 16 does not divide them"),
    ],
)
def test_unsplittable_lengths_raise_before_communicating(ranks, seq, dilation, layout, match):
    with pytest.raises(ValueError, match=match):
        ranks(2).run(bad_ring_call, seq, dilation, layout, timeout=60)


def dilated_gpt(world, dilation, backend):
    """ringify(NanoGPT, dilation=...) vs the same weights calling dilated_attention, one process."""
    import functools

    from ringify import ringify
    from ringify.testing.models import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(heads=6, dim=48).double()
    attend = functools.partial(dilated_attention, dilation=dilation)
    twin = NanoGPT(heads=6, dim=48, attend=attend).double()
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 64, (2, 32), generator=g) for _ in range(2))
    ringified = ringify(model, ring_size=world, dilation=dilation)
    torch._dynamo.reset()
    run = torch.compile(ringified, backend=backend, fullgraph=True) if backend else ringified

    def step(m, params):
        params.zero_grad(set_to_none=True)
        logits, loss = m(idx, targets)
        (loss + logits.square().mean()).backward()
        return logits.detach(), [p.grad for p in params.parameters()]

    def largest(got, want):
        grads = max((a - b).abs().max().item() for a, b in zip(got[1], want[1], strict=True))
        return (got[0] - want[0]).abs().max().item(), grads

    want = step(twin, twin)
    got = largest(step(run, model), want)
    control = inductor_control(twin, backend)
    bounds = (
        [inductor_bound(d) for d in largest(step(control, twin), want)]
        if control is not None
        else None
    )
    rewritten = ringified.report().rewritten[0]
    return *got, (rewritten.mask, rewritten.dilation), bounds or [1e-10, 1e-10]


@pytest.mark.parametrize(
    ("world", "backend"),
    [(w, b) for w in (1, 2, 4) for b in (None, "aot_eager")]
    + [pytest.param(2, "inductor", marks=pytest.mark.inductor_default)],
)
def test_ringified_model_with_dilation(ranks, world, backend):
    """Eager and compiled; under Inductor beside the twin's own move under it."""
    dilation = PATTERNS["spanning"]
    if world == 1:
        results = [dilated_gpt(1, dilation, backend)]
    else:
        results = ranks(world).run(dilated_gpt, world, dilation, backend, timeout=900)
    for logits, grads, mask, (logits_bound, grads_bound) in results:
        assert logits <= logits_bound and grads <= grads_bound, (logits, grads)
        assert mask == (MaskKind.CAUSAL, dilation)
