"""Writes into a tensor the graph made, rewritten as functional ops (``passes/folds/functional.py``):
the rewritten graph computes what the model computes, with no write left, where later reads
go through views of the written tensor (Qwen3.5's rotary embedding writes into
``freqs[0][..., idx]`` and reads ``freqs[0]`` again), and a write through a view it cannot
scatter into a tensor read again is an error naming the op."""

from __future__ import annotations

import pytest
import torch

from ringify.passes.folds.functional import functionalize_writes


class InterleavedSections(torch.nn.Module):
    """Qwen3.5's ``recomposition_frequencies``: each section written into a view of the
    first row, that view read again by the next write and by the result."""

    def forward(self, x):
        freqs = (x.unsqueeze(0).expand(3, -1, -1) * torch.arange(1.0, 4.0)[:, None, None]).sin()
        first = freqs[0]
        for dim, offset in enumerate((1, 2), start=1):
            first[..., offset:6:3] = freqs[dim, ..., offset:6:3]
        return torch.cat((first, first), dim=-1)


class ViewMadeBeforeTheWrite(torch.nn.Module):
    """A transposed view taken before the write and read after it sees the write."""

    def forward(self, x):
        y = x * 2
        seen = y.transpose(0, 1)
        y[:, 1] = 0.0
        y[0] += 1.0
        return seen * 3 + y.sum()


class ThroughAPermute(torch.nn.Module):
    """A write through a view it cannot scatter, read again: refused."""

    def forward(self, x):
        y = x * 2
        y.permute(1, 0)[0] = 0.0
        return y + 1


def rewritten(module: torch.nn.Module, x: torch.Tensor):
    program = torch.export.export(module, (x,), strict=False)
    gm = program.module()
    writes = functionalize_writes(gm)
    gm.graph.lint()
    gm.recompile()
    left = [
        n for n in gm.graph.nodes if n.op == "call_function" and n.target._schema.name.endswith("_")
    ]
    return gm, writes, left


@pytest.mark.parametrize(
    ("module", "count"), [(InterleavedSections(), 2), (ViewMadeBeforeTheWrite(), 3)]
)
def test_writes_become_functional_ops(module, count):
    x = torch.randn(4, 6, dtype=torch.float64)
    gm, writes, left = rewritten(module, x)
    assert writes == count and left == []
    torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)


def test_a_write_it_cannot_follow_is_refused():
    with pytest.raises(ValueError, match=r"writes in place into .* torch.cat or a functional op"):
        rewritten(ThroughAPermute(), torch.randn(4, 6))
