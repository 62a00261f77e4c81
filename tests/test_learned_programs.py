"""Learned mask programs: the ring op returns the gradient of a program's float inputs.

A bias computed from parameters (T5's bucket table, learned ALiBi slopes, a learned
per-key bias) is evaluated block by block and its inputs' gradients summed block by
block; every rank returns its part and ``copy_to_ring`` sums them. Compared with SDPA
on the whole sequence, its bias built by the same expressions, under autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify.passes.folds.mask_reader import read_program
from ringify.runtime import shard
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.program import DIFFERENTIABLE, MaskProgram

HEADS, BUCKETS = 2, 5
_CAUSAL = [
    ("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),
]


def _alibi(slopes, q_pos, k_pos):
    return slopes * (k_pos - q_pos).to(slopes.dtype)


def _buckets(q_pos, k_pos):
    return torch.clamp(k_pos - q_pos, -2, 2) + 2


def _key_bias(key, query):
    return key + query * 0.5


PROGRAMS = {
    # learned slopes (1, H, 1, 1) times key - query, causal
    "alibi": (
        MaskProgram(
            ("c",),
            (
                *_CAUSAL,
                ("sub.Tensor", ({"pos": "k"}, {"pos": "q"}), "int64"),
                ("cast", ({"op": 1},), "float64"),
                ("mul.Tensor", ({"in": 0}, {"op": 2}), "float64"),
                ("where.ScalarOther", ({"op": 0}, {"op": 3}, float("-inf")), "float64"),
            ),
        ),
        lambda g, seq: [torch.rand(1, HEADS, 1, 1, generator=g, dtype=torch.float64)],
        lambda x, q, k: torch.where(k <= q, _alibi(x[0], q, k), float("-inf")),
    ),
    # a bucket table (buckets, H) looked up at clamp(key - query)
    "table": (
        MaskProgram(
            ("p",),
            (
                ("sub.Tensor", ({"pos": "k"}, {"pos": "q"}), "int64"),
                ("lt.Scalar", ({"op": 0}, -2), "bool"),
                ("where.ScalarSelf", ({"op": 1}, -2, {"op": 0}), "int64"),
                ("gt.Scalar", ({"op": 2}, 2), "bool"),
                ("where.ScalarSelf", ({"op": 3}, 2, {"op": 2}), "int64"),
                ("add.Scalar", ({"op": 4}, 2), "int64"),
                ("embed", ({"in": 0}, {"op": 5}), "float64"),
            ),
        ),
        lambda g, seq: [torch.randn(BUCKETS, HEADS, generator=g, dtype=torch.float64)],
        lambda x, q, k: x[0][_buckets(q, k)].permute(2, 0, 1).unsqueeze(0),
    ),
    # a learned bias per key plus half of one per query
    "per-position": (
        MaskProgram(
            ("k", "q"),
            (
                ("mul.Scalar", ({"in": 1}, 0.5), "float64"),
                ("add.Tensor", ({"in": 0}, {"op": 0}), "float64"),
            ),
        ),
        lambda g, seq: [
            torch.randn(1, 1, 1, seq, generator=g, dtype=torch.float64),
            torch.randn(1, 1, seq, 1, generator=g, dtype=torch.float64),
        ],
        lambda x, q, k: _key_bias(x[0], x[1]),
    ),
}


def learned_ring(world, name, layout):
    """The ring op's output and gradients (q, k, v, each program input) vs SDPA's."""
    import torch.distributed as dist

    from ringify.runtime.collectives.reduce import copy_to_ring

    program, make_inputs, bias = PROGRAMS[name]
    seq = 8 * world
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, HEADS, seq, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    learned = [x.requires_grad_() for x in make_inputs(g, seq)]
    pos = torch.arange(seq)
    leaves = [t.clone().requires_grad_() for t in full]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=bias(learned, pos.view(-1, 1), pos))
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want.backward(dout)
    expected = [want, *[x.grad for x in leaves]]
    expected = [shard(t.detach(), 2, layout=layout) for t in expected]
    expected += [x.grad.clone() for x in learned]
    for x in learned:
        x.grad = None
    q, k, v = (shard(t, 2, layout=layout).requires_grad_() for t in full)
    group = dist.group.WORLD.group_name
    inputs = [copy_to_ring(x, group) for x in learned]
    spec = AttentionSpec(group, 0.5, False, layout, mask_program=program.text(), tiles_per_chunk=2)
    out, _ = torch.ops.ringify.ring_attention(q, k, v, None, inputs, seq, spec)
    out.backward(shard(dout, 2, layout=layout))
    got = [out.detach(), q.grad, k.grad, v.grad, *[x.grad for x in learned]]
    return max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_learned_program_gradients_match_sdpa(ranks, world, name, layout):
    for err in ranks(world).run(learned_ring, world, name, layout):
        assert err <= 1e-10, err


def test_a_learned_path_through_an_op_without_a_gradient_rule_is_kept():
    """abs has no gradient rule in a program: a mask whose learned part goes through it is
    kept (exact, with its tile gradients), and says why; an integer path through it is not
    learned and stays a program."""
    assert "abs.default" not in DIFFERENTIABLE

    class Model(torch.nn.Module):
        def __init__(self, learned_abs: bool):
            super().__init__()
            self.slope = torch.nn.Parameter(torch.ones(1, 1, 1, 1))
            self.learned_abs = learned_abs

        def forward(self, q):
            pos = torch.arange(q.shape[2])
            rel = (pos[None, :] - pos[:, None]).abs()
            bias = (self.slope * rel).abs() if self.learned_abs else self.slope * rel
            return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)

    from ringify.passes.folds.mask_reader import NotAProgram

    for learned_abs in (True, False):
        exported = torch.export.export(Model(learned_abs), (torch.randn(1, 1, 8, 4),))
        (sdpa,) = [n for n in exported.graph.nodes if "scaled_dot_product" in str(n.target)]
        if learned_abs:
            with pytest.raises(NotAProgram, match=r"abs\.default on a learned mask"):
                read_program(sdpa.args[3])
        else:
            program, inputs = read_program(sdpa.args[3])
            slope = inputs[program.roles.index("c")]
            assert slope.op == "placeholder" and program.dtype == torch.float32
