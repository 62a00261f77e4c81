"""FlexAttention on the ring: its ``mask_mod`` read as a mask program, its BlockMask gone.

A torchtitan-style decoder (``FlexTransformer``: ``create_block_mask`` and
``flex_attention`` in its forward, GQA), causal and causal within packed documents, on 2
and 4 ranks, float64. Outputs against the unmodified flex model; gradients against its
SDPA twin with the same weights (the same ``mask_mod`` as a dense mask), since FlexAttention
has no backward on the CPU: the model is traced once without gradients, and the rewritten
graph, which holds no flex op, then trains. The report: every attention a ring whose mask
is a program, no gathers, and no S x S node left of the BlockMask's computation.
"""

from __future__ import annotations

import pytest
import torch

from ringify.passes.graph.report import AttentionRun, MaskKind
from ringify.testing.runs import quadratic_nodes, ringified_run

TOL = 1e-10


def compare(
    length: int, documents: bool, backend: str | None, alibi: bool = False, strategy="auto"
):
    from ringify.testing.models import FlexTransformer

    torch.manual_seed(0)
    model = FlexTransformer(alibi=alibi).double()
    twin = FlexTransformer(attend="sdpa", alibi=alibi).double()
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, length), generator=g)
    docs = None
    if documents:  # documents of uneven lengths, a boundary inside each rank's part
        docs = torch.cumsum(torch.rand(2, length, generator=g) < 0.15, 1)
    inputs = (ids,) if docs is None else (ids, docs)
    weights = torch.randn(2, length, 64, generator=g, dtype=torch.float64)

    with torch.no_grad():
        flex_out = model(*inputs)
    ringified, run = ringified_run(model, backend, strategy=strategy)
    model.requires_grad_(False)
    with torch.no_grad():
        first = run(*inputs)  # traced without gradients: CPU flex has no backward
    model.requires_grad_(True)

    def step(fn, module):
        module.zero_grad(set_to_none=True)
        out = fn(*inputs)
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}

    want, got = step(twin, twin), step(run, model)
    report = ringified.report()
    return {
        "out": max((first - flex_out).abs().max().item(), (got[0] - flex_out).abs().max().item()),
        "twin": (want[0] - flex_out).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "runs": [(a.run, a.form, a.mask) for a in report.attentions],
        "notes": [a.strategy_note for a in report.attentions],
        "gathers": [x.op for x in report.gathers],
        "quadratic": quadratic_nodes(ringified, length),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("length", "documents"), [(48, False), (48, True), (45, True)])
def test_flex_model_matches_unmodified_model(ranks, world, length, documents):
    for r in ranks(world).run(compare, length, documents, None):
        assert r["runs"] == [(AttentionRun.RING, "flex_attention", MaskKind.PROGRAM)] * 2, r
        assert r["gathers"] == [] and r["quadratic"] == [], r
        assert r["out"] <= TOL and r["twin"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.parametrize("world", [2, 4])
def test_a_learned_score_mod(ranks, world):
    """ALiBi with learned slopes as a score_mod: a bias of the positions, added as the mask
    program's float values; the slopes' gradient comes from the ring, tile by tile."""
    for r in ranks(world).run(compare, 45, True, None, True):
        assert r["runs"] == [(AttentionRun.RING, "flex_attention", MaskKind.PROGRAM)] * 2, r
        assert r["gathers"] == [] and r["quadratic"] == [], r
        assert r["out"] <= TOL and r["twin"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("alibi", [False, True])
def test_flex_on_the_all_to_all(ranks, alibi, world):
    """``strategy="ulysses"``: FlexAttention's documents on a share of the heads; with ALiBi's
    learned slopes (a bias that differs per head) each rank evaluates its heads' share of it,
    and the slopes' gradient comes back from every rank's share."""
    for r in ranks(world).run(compare, 45, True, None, alibi, "ulysses"):
        assert r["runs"] == [(AttentionRun.ALL_TO_ALL, "flex_attention", MaskKind.PROGRAM)] * 2
        assert r["notes"] == ["", ""], r["notes"]
        assert r["gathers"] == [] and r["quadratic"] == [], r
        assert r["out"] <= TOL and r["twin"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled(ranks, backend):
    for r in ranks(2).run(compare, 48, True, backend):
        assert r["out"] <= TOL and r["grads"] <= TOL, r


def hf_flex(length: int):
    """HF Llama with attn_implementation="flex_attention" (float32: HF compiles flex, and
    Inductor's CPU flex takes no float64), without gradients; the tolerance is the model's
    own flex / SDPA difference on the same weights, measured here."""
    from ringify.testing import hf_models

    torch.manual_seed(0)
    model = hf_models.llama(attn_implementation="flex_attention").requires_grad_(False)
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.config._attn_implementation = "sdpa"
        sdpa = model(input_ids=ids).logits
        model.config._attn_implementation = "flex_attention"
        ringified, run = ringified_run(model)
        got = run(input_ids=ids).logits
    report = ringified.report()
    eps = torch.finfo(torch.float32).eps * want.abs().max().item()
    return {
        "diff": (got - want).abs().max().item(),
        "own": max((sdpa - want).abs().max().item(), eps),
        "runs": [(a.run, a.form, a.mask) for a in report.attentions],
        "notes": [a.strategy_note for a in report.attentions],
        "gathers": [x.op for x in report.gathers],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_hf_flex_attention(ranks, world):
    for r in ranks(world).run(hf_flex, 32):
        assert r["runs"] == [(AttentionRun.RING, "flex_attention", MaskKind.PROGRAM)] * 2, r
        assert r["gathers"] == [], r
        assert r["diff"] <= 4 * r["own"], r
