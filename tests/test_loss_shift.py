"""The loss shift by slicing (``logits[:, :-1]`` against ``labels[:, 1:]``) keeps the logits
sharded: the labels are shifted by a halo exchange, the last position ignored.

A nanoGPT-style model whose loss slices both sides, against the unmodified model on 2 and 4
ranks, float64, eager and compiled: the loss and every parameter gradient, with no gather.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringify.testing.runs import ringified_run

TOL = 1e-10


class SlicedLoss(nn.Module):
    def __init__(self, vocab=64, dim=32, reduction="mean"):
        super().__init__()
        from ringify.testing.models import Block

        self.reduction = reduction
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim, heads=4)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.block(self.embed(ids)))
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            labels[:, 1:].reshape(-1),
            reduction=self.reduction,
        )


def compare(length: int, reduction: str, backend: str | None):
    torch.manual_seed(0)
    model = SlicedLoss(reduction=reduction).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, length), generator=g)
    labels = ids.clone()
    labels[0, length // 2] = -100  # an ignored target among the others

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = step(model)
    ringified, run = ringified_run(model, backend)
    got = step(run)
    return {
        "loss": (got[0] - want[0]).abs().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "gathers": [x.op for x in ringified.report().gathers],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("length", "reduction"), [(16, "mean"), (13, "mean"), (16, "sum")])
def test_sliced_loss_without_gathers(ranks, world, length, reduction):
    for r in ranks(world).run(compare, length, reduction, None):
        assert r["gathers"] == [], r["gathers"]
        assert r["loss"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.parametrize("backend", ["aot_eager"])  # under Inductor: HF's shift, test_ringify
def test_compiled(ranks, backend):
    for r in ranks(2).run(compare, 16, "mean", backend):
        assert r["gathers"] == [], r["gathers"]
        assert r["loss"] <= TOL and r["grads"] <= TOL, r
