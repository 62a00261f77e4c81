"""Attention and sequence ops as models write them, each exact on the ring with nothing gathered:
a causal mask from constants (``einsum`` scores, ``nn.MultiheadAttention`` given it, with and
without its weights), nanoGPT's mask cropped from a registered ``tril`` buffer (a program, never
an S x S tensor per rank), a causal mask extended with ``F.pad`` (a program too), ALiBi's bias as
x-transformers makes it, or cuts it from the buffer it keeps (a program: a table of its
diagonals, looked up per pair), a
torchtitan-style layer (RoPE through ``stack``, under
``torch.autocast(enabled=False)``; GQA through ``enable_gqa``, ``repeat_interleave`` or
FlexAttention), a pooled token per row (CLIP's EOS: a few positions taken from their ranks) and
a router's per-position ops that torch leaves without the pointwise tag (``RoutedOutput``).
Float64, against the unmodified model: output and every gradient, on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

from ringify.passes.graph.report import MaskKind
from ringify.testing.runs import ringified_run

TOL = 1e-10
CASES = (
    "einsum", "mha", "mha weights", "nanogpt", "pad", "pad additive", "alibi", "alibi cached",
    "titan", "titan repeat", "titan flex", "pooled", "routed",
)  # fmt: skip


def _model(case: str):
    from ringify.testing import models

    torch.manual_seed(0)
    return {
        "einsum": lambda: models.ConstantMaskAttention(how="einsum"),
        "mha": lambda: models.ConstantMaskAttention(how="mha"),
        "mha weights": lambda: models.ConstantMaskAttention(how="mha", need_weights=True),
        "nanogpt": lambda: models.Block(32, 4, models.AttentionByHand(max_len=128)),
        "pad": lambda: models.ConstantMaskAttention(how="pad"),
        "pad additive": lambda: models.ConstantMaskAttention(how="pad additive"),
        "alibi": lambda: models.ConstantMaskAttention(how="alibi"),
        "alibi cached": lambda: models.ConstantMaskAttention(how="alibi cached"),
        "titan": models.RotaryDecoder,
        "titan repeat": lambda: models.RotaryDecoder(gqa="repeat_interleave"),
        "titan flex": lambda: models.RotaryDecoder(gqa="flex"),
        "pooled": lambda: models.RotaryDecoder(pooled=True),
        "routed": models.RoutedOutput,
    }[case]().double()


def compare(case: str):
    import torch.distributed as dist

    from ringify.testing.runs import quadratic_nodes

    model = _model(case)
    seq = 20 * dist.get_world_size()  # no dim of the models is this long
    g = torch.Generator().manual_seed(1)
    ids = case.startswith(("titan", "pooled"))
    x = (
        torch.randint(0, 64, (2, seq), generator=g)
        if ids
        else torch.randn(2, seq, 32, generator=g, dtype=torch.float64)
    )
    grads = case != "titan flex"  # FlexAttention has no backward on the CPU
    model.requires_grad_(grads)
    with torch.set_grad_enabled(grads):
        want = model(x)
        if grads:
            want.square().sum().backward()
        wanted = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        ringified, run = ringified_run(model)
        got = run(x)
        if grads:
            got.square().sum().backward()
    report = ringified.report()
    return {
        "out": (got - want).abs().max().item(),
        "grads": max(
            [
                (p.grad - wanted[n]).abs().max().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            ]
            or [0.0]
        ),
        "same grads": {n for n, p in model.named_parameters() if p.grad is not None} == set(wanted),
        "gathers": [(x.op, x.reason.value) for x in report.gathers],
        "masks": [a.mask for a in report.attentions],
        "quadratic": quadratic_nodes(ringified, seq),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_the_form_is_exact_and_nothing_is_gathered(ranks, world, case):
    for r in ranks(world).run(compare, case):
        assert r["out"] <= TOL and r["grads"] <= TOL and r["same grads"], r
        assert r["gathers"] == [], r["gathers"]
        assert r["quadratic"] == [], r["quadratic"]
        if not case.startswith(("titan", "pooled", "routed")):
            assert r["masks"] == [MaskKind.PROGRAM], r["masks"]
