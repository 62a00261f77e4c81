"""Activation checkpointing: the trace would drop it silently (every activation saved), so
a checkpointed model is refused with an error that names the fix, on every rank at once:
HF's gradient checkpointing (either form) and a reentrant torch.utils.checkpoint. (A
non-reentrant torch.utils.checkpoint in the model's own code leaves no mark in the graph
and is not detected.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ringify import ringify
from ringify.testing import outcome
from ringify.testing.hf_models import llama


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(x.shape)


class _Model(torch.nn.Module):
    """A block run through a reentrant ``checkpoint``, or positions under ``no_grad``."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.block, self.checkpointed = _Block(), checkpointed

    def forward(self, x):
        if not self.checkpointed:
            with torch.no_grad():
                scale = torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1) * 0 + 1
            return self.block(x * scale)
        return checkpoint(self.block, x, use_reentrant=True)


def test_a_reentrant_checkpointed_attention_is_refused():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=True") as e:
        ringify(_Model(checkpointed=True), ring_size=1)(x)
    assert "cannot keep activation checkpointing" in str(e.value)


def test_a_no_grad_region_without_attention_is_not_checkpointing():
    torch.manual_seed(0)
    model = _Model(checkpointed=False)
    x = torch.randn(2, 16, 8)
    assert torch.equal(ringify(model, ring_size=1)(x), model(x))


def hf_checkpointed(reentrant: bool):
    torch.manual_seed(0)
    model = llama()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return outcome(lambda: ringify(model, ring_size=2)(input_ids=ids, labels=ids))


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_is_refused_on_every_rank(ranks, reentrant):
    for kind, message, _ in ranks(2).run(hf_checkpointed, reentrant):
        assert kind == "ValueError" and "gradient_checkpointing_disable()" in message, message
