"""Joint-attention diffusion transformers on the ring (diffusers SD3, Flux, CogVideoX), against
the unmodified model in float64: output and every parameter gradient, 2 and 4 ranks, eager
and compiled.

Their text and image (or video) tokens are joined for attention and split back: the image
tokens stay sharded through every block, the text tokens replicated; each joint attention
is the ring (image queries) and the memory merge (text queries), each with a local block
over the text keys. What is still gathered is counted: SD3's and CogVideoX's final
unpatchify, a view that splits the sequence into a grid (one gather, at the output)."""

from __future__ import annotations

import pytest
import torch

from ringify.passes.report import AttentionRun
from ringify.testing.runs import ringified_run

pytest.importorskip("diffusers")

TOL = 1e-10
# (family, gathers): the ops still gathered (the unpatchify view at the output)
CASES = {"sd3": ["aten.reshape.default"], "flux": [], "cogvideox": ["aten.reshape.default"]}


def _run(model, fn, kwargs):
    model.zero_grad(set_to_none=True)
    out = fn(**kwargs)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def compare(name: str, backend: str | None, sizes: dict | None = None):
    from ringify.testing import diffusers_models

    torch.manual_seed(0)
    model, kwargs = getattr(diffusers_models, name)(**(sizes or {}))
    want = _run(model, model, kwargs)
    ringified, run = ringified_run(model, backend)
    got = _run(model, run, kwargs)
    report = ringified.report()
    return {
        "out": (got[0] - want[0]).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "same_grads": set(got[1]) == set(want[1]),
        "runs": {a.run for a in report.attentions},
        "gathers": [g.op for g in report.gathers],
        "padded": report.padded > report.length,
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_joint_attention_matches_unmodified_model(ranks, name, world):
    for r in ranks(world).run(compare, name, None):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["same_grads"], "every parameter gets a gradient (zeros where the model drops)"
        assert r["runs"] == {AttentionRun.RING, AttentionRun.MEMORY}, r["runs"]
        assert r["gathers"] == CASES[name], r["gathers"]


@pytest.mark.parametrize(
    ("name", "sizes", "world"),
    [("sd3", {"side": 10}, 2), ("flux", {"height": 5, "width": 5}, 4)],
)
def test_joint_attention_with_padding(ranks, name, sizes, world):
    """25 image tokens: the ring pads them to 28 (SD3, 2 ranks) or 32 (Flux, 4 ranks)."""
    for r in ranks(world).run(compare, name, None, sizes):
        assert r["padded"] and r["out"] < TOL and r["grads"] < TOL, r
        assert r["gathers"] == CASES[name], r["gathers"]


@pytest.mark.parametrize("name", ["flux", pytest.param("cogvideox", marks=pytest.mark.slow)])
def test_joint_attention_compiled(ranks, name):
    for r in ranks(2).run(compare, name, "aot_eager"):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["gathers"] == CASES[name], r["gathers"]
