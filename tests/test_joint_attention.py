"""Joint-attention diffusion transformers on the ring (diffusers SD3, Flux, CogVideoX;
QwenImage and HunyuanVideo under a padding mask of the text tokens; Chroma under a token
mask made a queries x keys matrix), against
the unmodified model in float64: output and every parameter gradient, 2 and 4 ranks, eager
and compiled.

Their text and image (or video) tokens are joined for attention and split back: the image
tokens stay sharded through every block, the text tokens replicated; each joint attention
is the ring (image queries) and the memory merge (text queries), each with a local block
over the text keys. Their last view into the image's grid keeps its rows sharded where
every chunk of the layout is whole rows (whole frames for CogVideoX): the sizes below are
chosen so; where the chunks cut them, the unpatchify runs on a share of the channels. Zero
gathers."""

from __future__ import annotations

import pytest
import torch

from ringify.passes.graph.report import AttentionRun
from ringify.testing.runs import inductor_control, ringified_run
from ringify.testing.tolerance import inductor_bound

pytest.importorskip("diffusers")

TOL = 1e-10
# (family, ranks) -> sizes whose chunks are whole rows (frames): SD3's 4 x 4 and 8 x 8
# patches; CogVideoX's 4 frames of 4 x 4 and 8 frames of 2 x 2
CASES = {
    ("sd3", 2): {}, ("sd3", 4): {"side": 16},
    ("flux", 2): {}, ("flux", 4): {},
    ("cogvideox", 2): {"frames": 13}, ("cogvideox", 4): {"frames": 29, "side": 4},
    # under a padding mask of the text tokens
    ("qwenimage", 2): {}, ("qwenimage", 4): {"side": 16}, ("hunyuan_video", 2): {},
    ("cogview4", 2): {},
    # under a token mask made a (queries x keys) matrix: text padding, and image tokens too
    ("chroma", 2): {}, ("chroma", 4): {"masked": 5},
}  # fmt: skip


def _run(model, fn, kwargs):
    model.zero_grad(set_to_none=True)
    out = fn(**kwargs)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _largest(got, want) -> tuple[float, float]:
    grads = max((got[1][n] - want[1][n]).abs().max().item() for n in want[1])
    return (got[0] - want[0]).abs().max().item(), grads


def compare(name: str, backend: str | None, sizes: dict | None = None):
    from ringify.testing import diffusers_models

    torch.manual_seed(0)
    model, kwargs = getattr(diffusers_models, name)(**(sizes or {}))
    want = _run(model, model, kwargs)
    ringified, run = ringified_run(model, backend)
    got = _run(model, run, kwargs)
    report = ringified.report()
    control = inductor_control(model, backend)  # Inductor's own move: the bound under it
    own = _largest(_run(model, control, kwargs), want) if control is not None else (0.0, 0.0)
    return {
        **dict(zip(("out", "grads"), _largest(got, want), strict=True)),
        "bounds": [inductor_bound(d) for d in own],
        "same_grads": set(got[1]) == set(want[1]),
        "runs": {a.run for a in report.attentions},
        "gathers": [g.op for g in report.gathers],
        "resharded": [r.node for r in report.resharded],
        "padded": report.padded > report.length,
    }


@pytest.mark.parametrize(("name", "world"), sorted(CASES))
def test_joint_attention_matches_unmodified_model(ranks, name, world):
    for r in ranks(world).run(compare, name, None, CASES[name, world]):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["same_grads"], "every parameter gets a gradient (zeros where the model drops)"
        assert {AttentionRun.RING, AttentionRun.MEMORY} <= r["runs"], r["runs"]  # a text-only
        # attention (HunyuanVideo's token refiner) runs replicated
        assert r["gathers"] == [], r["gathers"]


@pytest.mark.parametrize(
    ("name", "sizes", "world", "on_a_share"),
    [
        ("sd3", {"side": 6}, 2, 0),  # rows of 3, padded by a row: chunks of 3
        ("sd3", {"side": 10}, 2, 1),  # rows of 5 cut by chunks of 7
        ("flux", {"height": 5, "width": 5}, 4, 0),
    ],
)
def test_joint_attention_with_padding(ranks, name, sizes, world, on_a_share):
    """Image tokens padded: SD3's 9 to 12 and 25 to 28 on 2 ranks, Flux's 25 to 32 on 4
    ranks (Flux has no unpatchify: its tokens are its output). Where the chunks cut the
    rows, the unpatchify runs on every position of a share of its channels (one region),
    not gathered."""
    for r in ranks(world).run(compare, name, None, sizes):
        assert r["padded"] and r["out"] < TOL and r["grads"] < TOL, r
        assert r["gathers"] == [] and len(r["resharded"]) == on_a_share, r


@pytest.mark.parametrize(
    ("world", "sizes"),
    [
        (2, {"frames": 9}),  # 3 frames of 16 patches, chunks of 12
        # CogVideoX's own latent grid: 13 frames of 30 x 45 patches, chunks of 2194
        pytest.param(
            4, {"frames": 49, "side": 90, "height": 60, "layers": 1}, marks=pytest.mark.slow
        ),
    ],
)
def test_video_frames_cut_by_the_chunks_run_on_a_share_of_the_channels(ranks, world, sizes):
    """CogVideoX's unpatchify (a view into frames of patches, a permute, two flattens) where
    the layout's chunks cut the frames: one all-to-all moves its tokens onto a share of the
    output channels, every position there; nothing gathered, the output 1/P per rank."""
    for r in ranks(world).run(compare, "cogvideox", None, sizes):
        assert r["out"] < TOL and r["grads"] < TOL and r["same_grads"], r
        assert r["gathers"] == [], r["gathers"]
        [region] = r["resharded"]
        assert region.startswith("reshape"), r


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("flux", "aot_eager"),
        ("sd3", "aot_eager"),
        ("sd3", "inductor"),
        pytest.param("cogvideox", "aot_eager", marks=pytest.mark.slow),
    ],
)
def test_joint_attention_compiled(ranks, name, backend):
    """Under Inductor within 1.5x of the unmodified model's own move under it."""
    for r in ranks(2).run(compare, name, backend, CASES[name, 2], timeout=900):
        assert r["out"] <= r["bounds"][0] and r["grads"] <= r["bounds"][1], r
        assert r["gathers"] == [], r["gathers"]


@pytest.mark.parametrize("text_len", [1, 2])
def test_a_squeeze_runs_on_the_parts_only_where_no_part_loses_the_joint_dim(text_len):
    """``squeeze()`` of a joint (1, T + 8, 4) value: on the parts where each keeps the joint
    dim; put back together first where the text is one position long (its part's squeeze
    would drop the dim the whole keeps). Exact either way."""
    from ringify.passes.folds.joints import fold_joint_sequences

    class Joint(torch.nn.Module):
        def forward(self, text, image):
            y = torch.cat([text, image], 1).squeeze() * 2
            return y[:text_len], y[text_len:]

    text, image = torch.randn(1, text_len, 4), torch.randn(1, 8, 4)
    gm = torch.export.export(Joint(), (text, image), strict=False).module()
    assert fold_joint_sequences(gm) == (0 if text_len == 1 else 1)
    gm.recompile()
    for got, want in zip(gm(text, image), Joint()(text, image), strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
