"""``passes/folds/constants.py``: a cat leaves out the empty tensor constants an HF cache starts from
(export ties them to the trace's device), and computes exactly what it did."""

from __future__ import annotations

import torch

from ringify.passes.folds.constants import drop_empty_concatenated


class Starts(torch.nn.Module):
    def forward(self, x, y):
        empty = torch.tensor([], dtype=x.dtype, device=x.device)  # as HF's DynamicLayer
        wider = torch.tensor([], dtype=torch.float64, device=x.device)
        return (
            torch.cat([empty, x], dim=-2),  # one tensor left: its contiguous copy
            torch.cat([empty, x, y], dim=-2),  # two left: a cat of them
            torch.cat([wider, x], dim=-2),  # a float64 start promotes: it stays
        )


def _constants(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "get_attr"]


def test_empty_starts_leave_the_cats():
    x, y = torch.randn(2, 3, 4).transpose(1, 2), torch.randn(2, 5, 3)
    gm = torch.export.export(Starts(), (x, y)).module()
    want = gm(x, y)
    assert len(_constants(gm)) == 2  # the float32 start is read once
    drop_empty_concatenated(gm)
    gm.recompile()
    got = gm(x, y)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert a.is_contiguous()
    assert len(_constants(gm)) == 1  # only the promoting one is left
    cats = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert [len(n.args[0]) for n in cats] == [2, 2]
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 1 and clones[0].meta["val"].shape == want[0].shape
