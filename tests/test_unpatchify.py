"""Views of the sequence into an image's grid (an unpatchify): the rows stay sharded.

A diffusion transformer's tokens are an image's patches, row by row; its last layer views
them as (rows, columns) and permutes them into the image. Where every chunk of the
layout is whole rows, each rank keeps its rows through the view and the permute, and
only the model's output is gathered. Checked against the unmodified model in float64,
output and every gradient, on 2 and 4 ranks: a model of our own that also adds a grid
embedding, pads the sequence by whole rows and sums over the rows; diffusers' DiT and
PixArt; and a grid whose rows the chunks cut (gathered, the report says why).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringify.testing.runs import inductor_control, ringified_run
from ringify.testing.tolerance import inductor_bound

TOL = 1e-10


class GridModel(nn.Module):
    """Attention over ``rows * columns`` patch tokens, then their grid: a grid embedding
    added, permuted into an image, and a sum over the rows beside it."""

    def __init__(self, rows: int, columns: int, channels: int = 8, heads: int = 2):
        super().__init__()
        self.rows, self.columns, self.heads = rows, columns, heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.grid = nn.Parameter(torch.randn(1, rows, columns, channels))
        self.out = nn.Linear(channels, channels)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c)
        grid = self.out(y).view(b, self.rows, self.columns, c) + self.grid
        return torch.einsum("bhwc->bchw", grid), grid.sum(1)


class PatchGrid(GridModel):
    """``GridModel`` unpatchified as diffusers writes it: each token's channels unflattened
    into (channels, patch), permuted beside the grid's rows and columns, and flattened."""

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c)
        grid = self.out(y).unflatten(1, (self.rows, self.columns)).unflatten(-1, (c // 2, 2))
        return (grid + self.grid.unflatten(-1, (c // 2, 2))).permute(0, 3, 1, 2, 4).flatten(3, 4)


def _gradients(model, outputs):
    weights = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum() for o in outputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _largest(model, run, kwargs, want, want_grads) -> float:
    out = run(**kwargs)
    grads = _gradients(model, out)
    diffs = [(o - w).abs().max().item() for o, w in zip(out, want, strict=True)]
    return max(diffs + [(grads[n] - want_grads[n]).abs().max().item() for n in want_grads])


def compare(build, sizes: tuple = (), backend: str | None = None):
    torch.manual_seed(0)
    model, kwargs = build(*sizes)
    want = model(**kwargs)
    want_grads = _gradients(model, want)
    ringified, run = ringified_run(model, backend)
    got = run(**kwargs)
    got_grads = _gradients(model, got)
    report = ringified.report()
    control = inductor_control(model, backend)  # Inductor's own move: the bound under it
    own = _largest(model, control, kwargs, want, want_grads) if control is not None else 0.0
    return {
        "bound": inductor_bound(own),
        "out": max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)),
        "grads": max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads),
        "same_grads": set(got_grads) == set(want_grads),
        "gathers": [(g.op, g.reason, g.detail) for g in report.gathers],
        "resharded": [(r.node, r.entered, r.gathered) for r in report.resharded],
        "padded": report.padded > report.length,
    }


def grid_model(rows: int = 7, columns: int = 2):
    """14 tokens: padded to 16 by a whole row, 2 or 4 rows per rank's pair of chunks."""
    model = GridModel(rows, columns).double()
    return model, {"x": torch.randn(2, rows * columns, 8, dtype=torch.float64)}


def patch_grid(rows: int, columns: int):
    model = PatchGrid(rows, columns).double()
    return model, {"x": torch.randn(2, rows * columns, 8, dtype=torch.float64)}


def diffusers_model(name: str, side: int):
    from ringify.testing import diffusers_models

    model, kwargs = getattr(diffusers_models, name)(side)
    return model, kwargs


@pytest.mark.parametrize("world", [2, 4])
def test_grid_rows_stay_sharded(ranks, world):
    for r in ranks(world).run(compare, grid_model):
        assert r["padded"] and r["out"] < TOL and r["grads"] < TOL, r
        assert r["same_grads"] and r["gathers"] == [], r


@pytest.mark.parametrize("backend", ["aot_eager"])  # under Inductor: the joint DiT's test
def test_grid_rows_compiled(ranks, backend):
    for r in ranks(2).run(compare, grid_model, (), backend, timeout=900):
        assert r["out"] <= r["bound"] and r["grads"] <= r["bound"] and r["gathers"] == [], r


@pytest.mark.parametrize(("world", "side"), [(2, 8), (4, 16)])
@pytest.mark.parametrize("name", ["dit", "pixart"])
def test_image_diffusion_transformers(ranks, name, world, side):
    """(side / 2)^2 tokens in rows of side / 2: a row per chunk on 2 and on 4 ranks."""
    pytest.importorskip("diffusers")
    for r in ranks(world).run(compare, diffusers_model, (name, side)):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["same_grads"] and r["gathers"] == [], r


def test_rows_cut_by_the_chunks_run_on_a_share_of_the_channels(ranks):
    """Rows of 3 tokens, chunks of 2 (3 x 2 tokens, 4 ranks, zigzag): the view cannot keep the
    grid sharded, so it and the grid's ops (the embedding added, the permute, the sum over
    the rows) run on every position of a quarter of the channels, moved there by one
    all-to-all; nothing is gathered."""
    for r in ranks(4).run(compare, grid_model, (2, 3)):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["gathers"] == [], r
        [(node, entered, whole)] = r["resharded"]
        assert node.startswith("view") and [d for _, d in entered] == [2] and whole == (), r


def test_unflatten_and_flatten_run_on_a_share_of_the_channels(ranks):
    """The same cut rows, unpatchified by ``unflatten`` and ``flatten`` (diffusers' spelling):
    DTensor has no rule for either, so each is asked as the view it is, and ``unflatten``'s
    sizes are made local; one all-to-all onto the channels, nothing gathered."""
    for r in ranks(4).run(compare, patch_grid, (2, 3)):
        assert r["out"] < TOL and r["grads"] < TOL and r["same_grads"], r
        assert r["gathers"] == [], r
        [(node, entered, whole)] = r["resharded"]
        assert node.startswith("unflatten") and [d for _, d in entered] == [2] and whole == (), r
