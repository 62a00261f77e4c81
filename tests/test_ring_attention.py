"""ring_attention on 1, 2 and 4 gloo ranks against F.scaled_dot_product_attention on the full sequence."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime import ring_attention, shard
from ringify.runtime.attention.protocol import is_in_dim_order_of
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.collectives.layout import unshard
from ringify.testing.ring_vs_sdpa import (
    make_inputs,
    model_layout,
    reference,
    ring_forward_backward,
)
from ringify.testing.tolerance import EXACT, relative_difference, truth_tolerance

# float64 results must agree to rounding (EXACT: 1e-10 on O(1) values). Below float64 the
# rounding depends on the CPU's kernels: see assert_near_truth.


def run_ring(ranks, world, inputs, layout, kwargs, tiles=None):
    if world == 1:
        per_rank = [ring_forward_backward(*inputs, layout, kwargs, tiles)]
    else:
        per_rank = ranks(world).run(ring_forward_backward, *inputs, layout, kwargs, tiles)
    return [unshard([r[i] for r in per_rank], 2, layout) for i in range(4)]


def assert_matches(got, want, tol=EXACT):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        err = (g.double() - w.double()).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:g}"


def assert_near_truth(got, unmodified, truth):
    """A float32 or bfloat16 ring: its error from the float64 ``truth`` within a small factor
    of the ``unmodified`` computation's own (same dtype), measured here (``tolerance``)."""
    for name, g, u, t in zip(("out", "dq", "dk", "dv"), got, unmodified, truth, strict=True):
        assert g.shape == u.shape and g.dtype == u.dtype, name
        err, tol = relative_difference(g, t), truth_tolerance(u, t)
        assert err <= tol, f"{name}: error {err:.3g} from the truth > {tol:.3g}"


def test_a_float64_reference_that_is_the_truth_leaves_rounding():
    """On a GPU, SDPA's float64 kernel is the truth itself: its own error is 0, and a float64
    ring result is then held to rounding (``EXACT``), not to 0 (found on an H100)."""
    truth = torch.randn(64, dtype=torch.float64)
    assert truth_tolerance(truth, truth) == EXACT
    assert truth_tolerance(truth.float(), truth) > EXACT  # float32: its own error, or epsilons


def assert_matches_sdpa(got, inputs, kwargs):
    """Against SDPA on the full sequence: exactly in float64, near the truth below it."""
    if inputs[0].dtype == torch.float64:
        assert_matches(got, reference(*inputs, kwargs))
    else:
        truth = reference(*(t.double() for t in inputs), kwargs)
        assert_near_truth(got, reference(*inputs, kwargs), truth)


CASES = [
    # batch, heads, kv_heads, seq, dim, kwargs
    pytest.param(2, 4, 4, 48, 16, {}, id="mha"),
    pytest.param(1, 4, 4, 40, 8, {"scale": 0.37}, id="scale"),
    pytest.param(2, 6, 2, 24, 8, {"enable_gqa": True}, id="gqa"),
    pytest.param(1, 4, 1, 56, 8, {"enable_gqa": True}, id="mqa"),
]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "seq", "dim", "extra"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_sdpa(
    ranks, world, layout, is_causal, batch, heads, kv_heads, seq, dim, extra, dtype
):
    inputs = make_inputs(batch, heads, kv_heads, seq, dim, dtype)
    kwargs = {"is_causal": is_causal, **extra}
    got = run_ring(ranks, world, inputs, layout, kwargs)
    assert_matches_sdpa(got, inputs, kwargs)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [2, 3])
def test_tiled_matches_sdpa(ranks, world, layout, is_causal, tiles):
    """Several K/V tiles per chunk, each its own trip round the ring (7 rows: uneven tiles)."""
    seq = 7 * 2 * world
    inputs = make_inputs(2, 6, 2, seq, 8, torch.float64)
    kwargs = {"is_causal": is_causal, "enable_gqa": True}
    per_rank = ranks(world).run(ring_forward_backward, *inputs, layout, kwargs, tiles)
    got = [unshard([r[i] for r in per_rank], 2, layout) for i in range(4)]
    assert_matches(got, reference(*inputs, kwargs))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_bfloat16_matches_sdpa(ranks, world, is_causal):
    inputs = make_inputs(2, 4, 2, 40, 16, torch.bfloat16)
    kwargs = {"is_causal": is_causal, "enable_gqa": True}
    got = run_ring(ranks, world, inputs, "zigzag", kwargs)
    assert_matches_sdpa(got, inputs, kwargs)


def sliding_window(seq, window):
    pos = torch.arange(seq)
    offset = pos[:, None] - pos[None, :]
    return ((offset >= 0) & (offset < window))[None, None]


def masks(seq, heads, dtype):
    g = torch.Generator().manual_seed(3)
    padding = torch.ones(2, 1, seq, seq, dtype=torch.bool)
    padding[0, ..., seq - 5 :] = False  # the first sequence's last 5 keys are padding
    return {
        "window": sliding_window(seq, 5),
        "padding": padding,
        "bias": torch.randn(1, heads, seq, seq, generator=g, dtype=dtype),
        "bool-with-empty-rows": torch.rand(2, heads, seq, seq, generator=g) < 0.05,
    }


# (ring size, tiles per chunk): None lets ring_attention choose; 2 forces a tiled ring
@pytest.mark.parametrize(("world", "tiles"), [(1, None), (2, None), (2, 2), (4, None), (4, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mask", ["window", "padding", "bias", "bool-with-empty-rows"])
def test_mask_matches_sdpa(ranks, world, tiles, layout, mask):
    """A kept mask: rows sharded with the queries, columns cut per ring step by the op."""
    seq = 8 * world
    inputs = make_inputs(2, 4, 2, seq, 8, torch.float64)
    kwargs = {"attn_mask": masks(seq, 4, torch.float64)[mask], "enable_gqa": True}
    if tiles is None:
        got = run_ring(ranks, world, inputs, layout, kwargs)
    else:
        per_rank = ranks(world).run(ring_forward_backward, *inputs, layout, kwargs, tiles)
        got = [unshard([r[i] for r in per_rank], 2, layout) for i in range(4)]
    assert_matches(got, reference(*inputs, kwargs))


# Every mask shape SDPA accepts for 4-D q: 2-D to 4-D, any dim broadcast (size 1).
MASK_SHAPES = [
    (2, 4, "S", "S"),
    (2, 1, 1, "S"),  # nn.MultiheadAttention's key padding
    (1, 4, "S", "S"),
    (2, 1, "S", "S"),
    (1, 1, 1, "S"),
    (2, 1, "S", 1),
    (1, 1, 1, 1),
    (4, "S", "S"),
    (1, "S", "S"),
    (4, 1, "S"),
    ("S", "S"),
    (1, "S"),
    ("S", 1),
]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_every_mask_shape_matches_sdpa(ranks, world, layout, dtype, mask_shape):
    seq = 8 * world
    shape = [seq if d == "S" else d for d in mask_shape]
    g = torch.Generator().manual_seed(5)
    if dtype == torch.bool:
        mask = torch.rand(shape, generator=g) < 0.7
    else:
        mask = torch.randn(shape, generator=g, dtype=dtype)
    inputs = make_inputs(2, 4, 2, seq, 8, torch.float64)
    kwargs = {"attn_mask": mask, "enable_gqa": True}
    got = run_ring(ranks, world, inputs, layout, kwargs)
    assert_matches(got, reference(*inputs, kwargs))


def padded_forward_backward(q, k, v, dout, layout, key_len, is_causal, tiles):
    import torch.distributed as dist

    q, k, v, dout = (
        shard(t, 2, layout=layout).detach().clone().requires_grad_(t is not dout)
        for t in (q, k, v, dout)
    )
    name = dist.group.WORLD.group_name if dist.is_initialized() else ""
    spec = AttentionSpec(name, 0.35, is_causal, layout, tiles_per_chunk=tiles)
    out, _ = torch.ops.ringify.ring_attention(q, k, v, None, [], key_len, spec)
    out.backward(dout)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [1, 2])
def test_padding_keys_are_cut(ranks, world, layout, is_causal, tiles):
    """Keys at positions >= key_len (the pass's padding) are ignored, and get no gradient.

    With 2 tiles per chunk the last tile is all padding: no query sees it."""
    seq, key_len = 8 * world, 8 * world - 5
    inputs = make_inputs(1, 2, 2, seq, 8, torch.float64)
    per_rank = ranks(world).run(padded_forward_backward, *inputs, layout, key_len, is_causal, tiles)
    got = [unshard([r[i] for r in per_rank], 2, layout) for i in range(4)]
    mask = torch.ones(seq, seq, dtype=torch.bool)
    mask[:, key_len:] = False
    if is_causal:
        mask &= torch.ones(seq, seq, dtype=torch.bool).tril()
    want = reference(*inputs, {"attn_mask": mask, "scale": 0.35})
    assert_matches(got, want)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_bf16_error_does_not_grow(ranks, world):
    """bf16 ring error vs a float64 truth stays within 1.2x of single-process bf16 SDPA's."""
    inputs = make_inputs(2, 4, 2, 128, 32, torch.bfloat16)
    kwargs = {"is_causal": True, "enable_gqa": True}
    truth = reference(*(t.double() for t in inputs), kwargs)
    sdpa = reference(*inputs, kwargs)
    if world == 8:  # oversubscribed: a throwaway pool, not kept for the session
        from ringify.testing import RankPool

        pool = RankPool(8)
        try:
            per_rank = pool.run(ring_forward_backward, *inputs, "zigzag", kwargs)
        finally:
            pool.close()
        got = [unshard([r[i] for r in per_rank], 2, "zigzag") for i in range(4)]
    else:
        got = run_ring(ranks, world, inputs, "zigzag", kwargs)
    for name, g, s, t in zip(("out", "dq", "dk", "dv"), got, sdpa, truth, strict=True):
        ring_err, sdpa_err = relative_difference(g, t), relative_difference(s, t)
        assert ring_err <= 1.2 * sdpa_err, f"{name}: ring {ring_err:.3g} vs sdpa {sdpa_err:.3g}"


def laid_out(t, order):
    """The same values, with dims lying in memory in ``order`` (outermost first)."""
    inverse = [order.index(d) for d in range(t.dim())]
    return t.permute(order).contiguous().permute(inverse)


PERMUTATIONS = list(itertools.permutations(range(4)))


def strided_forward_backward(q, k, v, dout, layout, kwargs):
    """Every memory order for each of q, k and v (24 cases, each order once per tensor)."""
    results = []
    for i, order in enumerate(PERMUTATIONS):
        orders = (order, PERMUTATIONS[(i + 7) % 24], PERMUTATIONS[(i + 13) % 24])
        local = [shard(t, 2, layout=layout) for t in (q, k, v, dout)]
        qkv = [laid_out(t, o).requires_grad_() for t, o in zip(local, orders, strict=False)]
        out = ring_attention(*qkv, layout=layout, **kwargs)
        out.backward(local[3])
        results.append([out.detach()] + [t.grad for t in qkv])
    return results


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_every_memory_order_matches_sdpa(ranks, world, layout, is_causal):
    inputs = make_inputs(2, 4, 2, 8 * world, 8, torch.float64)
    kwargs = {"is_causal": is_causal, "enable_gqa": True}
    job = (strided_forward_backward, *inputs, layout, kwargs)
    per_rank = [job[0](*job[1:])] if world == 1 else ranks(world).run(*job)
    want = reference(*inputs, kwargs)
    for case in range(len(PERMUTATIONS)):
        got = [unshard([r[case][i] for r in per_rank], 2, layout) for i in range(4)]
        assert_matches(got, want)


def gradient_layouts(q, k, v, dout, is_causal, tiles):
    """On every rank: whether the backward op's dq, dk and dv lie in the dim orders of q, k and
    v given in a model's layout ((B, S, H, D) in memory), and their values."""
    import torch.distributed as dist

    q, k, v, dout = (model_layout(shard(t, 2, layout="zigzag")) for t in (q, k, v, dout))
    name, world = dist.group.WORLD.group_name, dist.get_world_size()
    spec = AttentionSpec(name, 0.3, is_causal, "zigzag", tiles_per_chunk=tiles)
    args = (None, [], q.shape[2] * world, spec)
    out, lse = torch.ops.ringify.ring_attention(q, k, v, *args)
    grads = torch.ops.ringify.ring_attention_backward(dout, q, k, v, out, lse, *args)[:3]
    return [is_in_dim_order_of(x, g) for x, g in zip((q, k, v), grads, strict=True)], grads


@pytest.mark.parametrize(("world", "tiles"), [(1, 1), (2, 1), (2, 2)])  # one rank: no tiling
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_gradients_come_back_in_their_inputs_layout(ranks, world, tiles, is_causal, dtype):
    """As SDPA's backward: a model's q, k and v are views of its projections, and gradients laid
    out as they are go back through the model's transpose and reshape without a copy (in
    bfloat16 too, where the float32 sums are converted on the way)."""
    inputs = make_inputs(1, 4, 2, 8 * world, 8, dtype)
    per_rank = ranks(world).run(gradient_layouts, *inputs, is_causal, tiles)
    assert all(all(layouts) for layouts, _ in per_rank)
    if dtype != torch.float64:  # values: the float64 runs, and the bfloat16 tests' bounds
        return
    want = reference(*inputs, {"is_causal": is_causal, "scale": 0.3, "enable_gqa": True})
    for i, name in enumerate(("dq", "dk", "dv")):
        got = unshard([grads[i] for _, grads in per_rank], 2, "zigzag")
        assert (got - want[i + 1]).abs().max() <= EXACT, name


@pytest.mark.parametrize(("world", "tiles"), [(1, None), (2, None), (4, None), (2, 2), (4, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nan_and_inf_propagate_as_in_sdpa(ranks, world, layout, is_causal, tiles):
    """A NaN in q or k gives NaN rows, and an inf in v gives inf, where SDPA does; with two
    tiles a chunk too, so that a NaN row's first block is the accumulator, merged into later.

    SDPA also gives NaN where a row cannot see the inf (0 * inf in its dense product,
    over whatever its kernel's block covers); the ring skips what a row cannot see, so
    there it may be finite. It is never NaN where SDPA is not, and equal where SDPA is
    finite or infinite.
    """
    seq = 8 * world
    q, k, v, dout = make_inputs(2, 2, 2, seq, 8, torch.float64)
    q[0, 1, 3] = float("nan")  # one query row
    v[0, 0, seq - 2, 5] = float("inf")
    k[1, 1, 0, 2] = float("nan")  # the first key: the only one the first causal row sees
    inputs = (q, k, v, dout)
    kwargs = {"is_causal": is_causal}
    got = run_ring(ranks, world, inputs, layout, kwargs, tiles)
    want = reference(*inputs, kwargs)
    assert want[0][0, 1, 3].isnan().all() and got[0][0, 1, 3].isnan().all()
    assert want[0][1, 1].isnan().all() and got[0][1, 1].isnan().all()
    assert want[0].isinf().any()  # the case is not vacuous
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert not (g.isnan() & ~w.isnan()).any(), f"{name}: NaN where SDPA has none"
        assert torch.equal(g[w.isinf()], w[w.isinf()]), f"{name}: SDPA's inf lost"
        finite = w.isfinite()
        err = (g[finite] - w[finite]).abs().max() if finite.any() else 0.0
        assert err <= EXACT, name


@pytest.mark.parametrize(("world", "tiles"), [(2, None), (2, 2), (4, None)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_row_of_nan_scores_is_nan_in_float32(ranks, world, layout, tiles):
    """The CPU kernel gives a float32 causal row whose every score is NaN out = 0 and lse = 0;
    the ring marks it NaN as SDPA has it, also where that row's only block is taken as the
    call's whole result (one tile, the first rank's shard) and where it is merged (two)."""
    seq = 8 * world
    q, k, v, dout = make_inputs(1, 2, 2, seq, 8, torch.float32)
    k[0, 1, 0, 2] = float("nan")  # the only key the first causal row sees
    inputs = (q, k, v, dout)
    kwargs = {"is_causal": True}
    got = run_ring(ranks, world, inputs, layout, kwargs, tiles)
    want = reference(*inputs, kwargs)
    assert want[0][0, 1, 0].isnan().all()  # the case is not vacuous
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan()), name


def mask_gradient(q, k, v, dout, mask, layout, tiles):
    """On every rank: the gradient of this rank's part of a learned ``mask`` (its query rows,
    every key column), from the op with ``tiles`` tiles per chunk."""
    import torch.distributed as dist

    q, k, v, dout = (shard(t, 2, layout=layout) for t in (q, k, v, dout))
    rows = mask.dim() >= 2 and mask.shape[-2] > 1
    mask = (shard(mask, -2, layout=layout) if rows else mask).detach().clone().requires_grad_()
    name, full = dist.group.WORLD.group_name, q.shape[2] * dist.get_world_size()
    scale = q.shape[-1] ** -0.5
    if tiles is None:  # the public function, which picks the tiling
        out = ring_attention(q, k, v, attn_mask=mask, layout=layout, enable_gqa=True)
    else:
        spec = AttentionSpec(name, scale, False, layout, tiles_per_chunk=tiles)
        out, _ = torch.ops.ringify.ring_attention(q, k, v, mask, [], full, spec)
    out.backward(dout)
    return mask.grad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("tiles", [None, 1, 2])
@pytest.mark.parametrize(
    "mask_shape", [(2, 4, "S", "S"), (4, "S", "S"), (1, "S"), ("S", 1)], ids=str
)
def test_learned_mask_gradient_matches_sdpa(ranks, world, layout, tiles, mask_shape):
    """The gradient of a float mask (a learned bias), tile by tile over the ring, summed over
    its broadcast dims as SDPA's: every shape, tilings, layouts."""
    seq = 8 * world
    shape = [seq if d == "S" else d for d in mask_shape]
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs = make_inputs(2, 4, 2, seq, 8, torch.float64)
    per_rank = ranks(world).run(mask_gradient, *inputs, mask, layout, tiles)
    rows = len(shape) >= 2 and shape[-2] > 1
    got = unshard(per_rank, len(shape) - 2, layout) if rows else sum(per_rank)
    q, k, v, dout = inputs
    learned = mask.clone().requires_grad_()
    F.scaled_dot_product_attention(q, k, v, attn_mask=learned, enable_gqa=True).backward(dout)
    assert got.shape == learned.grad.shape
    assert (got - learned.grad).abs().max().item() <= 1e-10
