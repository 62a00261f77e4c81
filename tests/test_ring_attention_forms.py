"""The ring op's forms beyond SDPA: attention sinks (gpt-oss), soft-capped scores (Gemma 2) and
a value head dim other than q's and k's (MLA), alone and together, with causal, packed-document
programs, a kept bias and GQA. Against their definition on the full sequence
(``runtime/attention/reference.py``, itself checked against SDPA), float64, forward and every
gradient (the sinks' too), on 2 and 4 ranks and several tilings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime import gather, shard
from ringify.runtime.attention.reference import attention
from ringify.runtime.attention.spec import AttentionSpec
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs
from ringify.testing.tolerance import EXACT

SEQ = 24  # per rank


def _inputs(world: int, dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq = SEQ * world

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(2, 4, seq, 12), randn(2, 2, seq, 12), randn(2, 2, seq, dv)
    return q, k, v, randn(2, 4, seq, dv), randn(1, 4, 1, 1)


def _mask(case: str, seq: int):
    """(is_causal, program, its inputs, a kept bias) of ``case``."""
    if case == "causal":
        return True, "", [], None
    if case == "packed":
        lengths = [seq // 3, seq // 2, seq - seq // 3 - seq // 2]
        return False, document_causal_program(), document_inputs(lengths), None
    g = torch.Generator().manual_seed(5)
    return False, "", [], torch.randn(1, 4, seq, seq, generator=g, dtype=torch.float64)


def _dense(case: str, seq: int):
    """The same mask as SDPA takes it (a bool or float tensor), for the reference."""
    _, _, inputs, bias = _mask(case, seq)
    if case == "packed":
        docs = inputs[0].view(-1)
        positions = torch.arange(seq)
        return (docs[:, None] == docs[None, :]) & (positions[None, :] <= positions[:, None])
    return bias


def ring_forms(world_case: tuple, sinks_on: bool, softcap: float, dv: int, tilings=(0, 2)):
    """On every rank: per tiling, the gathered output and gradients."""
    return [_ring_forms(world_case, sinks_on, softcap, dv, tiles) for tiles in tilings]


def _ring_forms(world_case: tuple, sinks_on: bool, softcap: float, dv: int, tiles: int):
    import torch.distributed as dist

    world, case = world_case
    q, k, v, dout, sinks = _inputs(world, dv)
    seq = q.shape[2]
    causal, program, inputs, bias = _mask(case, seq)
    layout, name, scale = "zigzag", dist.group.WORLD.group_name, 12**-0.5
    local = [shard(t, 2, layout=layout).requires_grad_(t is not dout) for t in (q, k, v, dout)]
    ql, kl, vl, dl = local
    sinks_l = sinks.clone().requires_grad_() if sinks_on else None
    mask_l = None if bias is None else shard(bias, 2, layout=layout)
    width = max(ql.shape[-1], vl.shape[-1])  # the pass pads the narrower head dim so
    vp = F.pad(vl, (0, width - vl.shape[-1]))
    spec = AttentionSpec(name, scale, causal, layout, softcap, program, tiles)
    out, _ = torch.ops.ringify.ring_attention(ql, kl, vp, mask_l, inputs, seq, spec, sinks=sinks_l)
    out = out[..., :dv]
    out.backward(dl)
    got = [gather(t.detach(), 2, layout=layout) for t in (out, ql.grad, kl.grad, vl.grad)]
    if sinks_on:  # each rank's rows' part of the sinks' gradient, summed over the ring
        dist.all_reduce(sinks_l.grad)
        got.append(sinks_l.grad)
    return got


def reference(world: int, case: str, sinks_on: bool, softcap: float, dv: int):
    q, k, v, dout, sinks = _inputs(world, dv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = sinks.requires_grad_() if sinks_on else None
    causal = _mask(case, q.shape[2])[0]
    out = attention(
        q, k, v, _dense(case, q.shape[2]), is_causal=causal, scale=12**-0.5, enable_gqa=True,
        sinks=sinks, softcap=softcap,
    )  # fmt: skip
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad] + ([sinks.grad] if sinks_on else [])


def test_the_reference_is_sdpa_without_sinks_or_cap():
    q, k, v, _, _ = _inputs(1, 12)
    mask = _dense("packed", q.shape[2])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = attention(q, k, v, mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=EXACT)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["causal", "packed", "bias"])
@pytest.mark.parametrize(
    ("sinks_on", "softcap", "dv"),
    [(True, 0.0, 12), (False, 2.0, 12), (False, 0.0, 8), (True, 2.0, 8)],
    ids=["sinks", "softcap", "value-dim", "all"],
)
def test_ring_forms_match_their_definition(ranks, world, case, sinks_on, softcap, dv):
    want = reference(world, case, sinks_on, softcap, dv)
    for tilings in ranks(world).run(ring_forms, (world, case), sinks_on, softcap, dv):
        for got in tilings:  # the op's own tiling and two tiles per chunk
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=EXACT)


def test_a_sink_changes_the_result():
    """The sinks are not a no-op here: the test above can fail."""
    q, k, v, _, sinks = _inputs(1, 12)
    with_sink = attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks + 3)
    without = attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (with_sink - without).abs().max() > 1e-3
