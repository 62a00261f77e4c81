"""Load balancing inside the ring op (``ringify/runtime/masks/balance.py``).

Packed documents of uneven length give zigzag's ranks unequal work; the op deals its
tiles to the ranks by work and runs on that plan, moving rows there and back. The
plan must keep every buffer's shape and every tile exactly once, must pay off in the
op's own time model, and must leave the results exact: forward, q/k/v gradients and
a learned program input's gradient, against SDPA on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime import shard
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.balance import (
    DEVICE_MOVE_AREA,
    MIN_GAIN,
    balanced_tiling,
    min_gain_area,
    ring_time,
    tile_costs,
    tile_owners,
)
from ringify.runtime.masks.program import parse
from ringify.runtime.masks.tile_masks import TileMasks
from ringify.runtime.tiling.tiles import all_tiles, shard_tiles
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs, model_layout

PER_CHUNK = 4
# (ring size, document lengths): zigzag leaves these unbalanced at 4 tiles per chunk
UNEVEN = {2: [6, 40, 18], 4: [13, 60, 7, 48]}


def _home(world: int, seq: int, layout: str = "zigzag"):
    return lambda r: shard_tiles(r, world, seq // world, layout, True, PER_CHUNK)


def _plan(home, world: int, lengths: list[int]):
    """The op's balanced plan for documents of ``lengths`` (None: kept home)."""
    masks = TileMasks(home, world, None, False, sum(lengths), *_documents(lengths))
    return balanced_tiling(masks)


def _documents(lengths: list[int]) -> tuple[str, list[torch.Tensor]]:
    return document_causal_program(), document_inputs(lengths)


@pytest.mark.parametrize(("world", "layout"), [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_plan_keeps_shapes_and_pays_off(world, layout):
    lengths = UNEVEN[world]
    seq, inputs = sum(lengths), document_inputs(lengths)
    home = _home(world, seq, layout)
    work = _plan(home, world, lengths)
    assert work is not None
    tiles = all_tiles(home, world)
    assert sorted(t.key for t in all_tiles(work, world)) == [t.key for t in tiles]
    for r in range(world):  # same local rows, same tiles per sub-ring: buffers keep shape
        assert [t.rows for t in work(r)] == [t.rows for t in home(r)]
        assert sorted(t.sub_ring for t in work(r)) == sorted(t.sub_ring for t in home(r))
        for t in work(r):  # a tile's rows are its global positions' count
            assert t.length == next(h.length for h in tiles if h.key == t.key)
        own = {t.key: t.rows for t in home(r)}  # a tile that stays keeps its rows
        assert all(t.rows == own[t.key] for t in work(r) if t.key in own)
    costs = tile_costs(tiles, parse(document_causal_program()), inputs, seq)
    sub_rings = torch.tensor([t.sub_ring for t in tiles])
    owners = {name: tile_owners(t, tiles, world) for name, t in (("home", home), ("work", work))}
    before, after = (
        ring_time(costs, owners[n], owners["home"], sub_rings, world) for n in ("home", "work")
    )
    assert after <= (1 - MIN_GAIN) * before
    busiest = {  # the busiest rank's work
        n: torch.zeros(world, dtype=torch.float64).index_add_(0, o, costs.sum(1)).max()
        for n, o in owners.items()
    }
    assert busiest["work"] < busiest["home"]


def test_an_accelerator_balances_only_where_the_kernels_gain_more_than_the_moves_cost():
    """On an accelerator a plan must also save ``DEVICE_MOVE_AREA`` of kernel area (its moves
    cost every call's host ~50 launches): the uneven documents scaled 64x gain ~1100^2 (kept
    home there, balanced on the CPU), scaled 128x ~2200^2 (balanced on both)."""
    assert min_gain_area("cpu") == 0 and min_gain_area("cuda") == DEVICE_MOVE_AREA
    for scale, on_an_accelerator in ((64, False), (128, True)):
        lengths = [n * scale for n in UNEVEN[2]]
        seq = sum(lengths)
        masks = TileMasks(_home(2, seq), 2, None, False, seq, *_documents(lengths))
        assert balanced_tiling(masks, min_gain_area("cpu")) is not None
        assert (balanced_tiling(masks, min_gain_area("cuda")) is not None) == on_an_accelerator


def test_one_document_keeps_zigzag():
    """Zigzag already balances one causal document: no plan, nothing moves."""
    assert _plan(_home(2, 64), 2, [64]) is None


def test_tile_costs_count_what_the_program_leaves_visible():
    """Two documents of one tile each: a tile pair across documents costs nothing, a
    tile with itself its whole area (the bounds cannot see the triangle)."""
    tiles = all_tiles(lambda r: shard_tiles(r, 2, 16, "contiguous", True, 2), 2)
    program = parse(document_causal_program())
    costs = tile_costs(tiles, program, document_inputs([8, 8, 8, 8]), 32)
    assert torch.equal(costs, torch.eye(4, dtype=torch.float64) * 64)


def balanced_ring(world, lengths, learned, models_layout=False):
    """The ring op with a document program, balanced and not, vs SDPA on the whole
    sequence: forward, q/k/v gradients and (``learned``) the per-key bias's."""
    import torch.distributed as dist

    from ringify.runtime.collectives.ring import SentBytes

    seq, (q_docs, k_docs) = sum(lengths), document_inputs(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, h, seq, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)
    )
    bias = torch.randn(1, seq, generator=g, dtype=torch.float64)
    visible = (q_docs == k_docs) & torch.ones(seq, seq).tril().bool()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    mask = torch.where(visible, leaves[3], float("-inf")) if learned else visible
    want = F.scaled_dot_product_attention(*leaves[:3], attn_mask=mask, enable_gqa=True)
    want.backward(dout)
    expected = [
        shard(t, 2, layout="zigzag") for t in (want.detach(), *(x.grad for x in leaves[:3]))
    ]
    name = dist.group.WORLD.group_name
    results = {}
    for balance in (True, False):
        local = [shard(t, 2, layout="zigzag") for t in (q, k, v)]
        if models_layout:  # (B, H, S, D) views of (B, S, H, D): moved rows travel as they lie
            local = [model_layout(x) for x in local]
        local = [x.requires_grad_() for x in local]
        inputs = [q_docs, k_docs]
        if learned:
            inputs.append(bias.clone().requires_grad_())
        program = document_causal_program(learned)
        spec = AttentionSpec(name, 8**-0.5, False, "zigzag", 0.0, program, PER_CHUNK, balance)
        args = (None, inputs, seq, spec)
        with SentBytes() as sent:
            out, _ = torch.ops.ringify.ring_attention(*local, *args)
            out.backward(shard(dout, 2, layout="zigzag"))
        got = [out.detach(), *(x.grad for x in local)]
        if learned:  # each rank returns its part; the graph's copy_to_ring sums them
            part = inputs[2].grad.clone()
            dist.all_reduce(part)
            got.append(part)
        results[balance] = (got, sent.bytes)
    if learned:
        expected.append(leaves[3].grad)
    return results, expected


@pytest.mark.parametrize(
    ("learned", "models_layout"), [(False, False), (True, False), (False, True)]
)
@pytest.mark.parametrize("world", [2, 4])
def test_balanced_ring_is_exact(ranks, world, learned, models_layout):
    per_rank = ranks(world).run(balanced_ring, world, UNEVEN[world], learned, models_layout)
    for results, expected in per_rank:
        for balance in (True, False):
            for got, want in zip(results[balance][0], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the balanced run moved rows: more bytes on some rank than the zigzag run
    assert sum(r[True][1] for r, _ in per_rank) > sum(r[False][1] for r, _ in per_rank)


def moved_layout(world, lengths):
    """``rows_in`` gives every tile of the plan at its global rows and receives only the
    tiles that change rank; ``move_home`` brings a plan-laid tensor home in place."""
    import torch.distributed as dist

    from ringify.runtime.attention.transport import move_home, rows_in
    from ringify.runtime.collectives.ring import ring_by_name

    rank, seq = dist.get_rank(), sum(lengths)
    ring = ring_by_name(dist.group.WORLD.group_name)
    home = _home(world, seq)
    plan = _plan(home, world, lengths)
    full = torch.arange(2 * 3 * seq, dtype=torch.float64).view(2, 3, seq)  # (B, H, S)
    local = torch.empty(2, 3, seq // world, dtype=torch.float64)
    for t in home(rank):
        local[:, :, t.rows] = full[:, :, t.start : t.start + t.length]
    (at,) = rows_in(ring, [local], home, plan)
    for t in plan(rank):
        assert torch.equal(at[t.rows], full[:, :, t.start : t.start + t.length])
    arrived = sum(t.length for t in plan(rank) if t.key not in {h.key for h in home(rank)})
    laid = torch.empty_like(local)
    for t in plan(rank):
        laid[:, :, t.rows] = full[:, :, t.start : t.start + t.length]
    move_home(ring, [laid], plan, home)
    return at.moved_rows(), arrived, torch.equal(laid, local)


@pytest.mark.parametrize("world", [2, 4])
def test_only_moved_tiles_travel(ranks, world):
    per_rank = ranks(world).run(moved_layout, world, UNEVEN[world])
    for moved, arrived, home_again in per_rank:
        assert moved == arrived
        assert home_again
    assert sum(moved for moved, _, _ in per_rank) > 0


def test_tiles_side_by_side_travel_as_one_message():
    """A balanced plan places arriving tiles in the order their home ranks send them, so that
    tiles side by side on both ranks move as one message, every row once."""
    from ringify.runtime.attention.transport import _moves

    lengths = UNEVEN[2]
    home = _home(2, sum(lengths))
    plan = _plan(home, 2, lengths)
    for r in range(2):
        sends, receives = _moves(home, plan, r, 2)
        moved_in = [t for t in plan(r) if t.key not in {h.key for h in home(r)}]
        moved_out = [t for t in home(r) if t.key not in {p.key for p in plan(r)}]
        assert sum(rows.stop - rows.start for _, rows in receives) == sum(
            t.length for t in moved_in
        )
        assert sum(rows.stop - rows.start for _, rows in sends) == sum(t.length for t in moved_out)
        assert len(receives) < len(moved_in) and len(sends) < len(moved_out)
