"""Load balancing inside the ring op (``ringify/runtime/balance.py``).

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
from ringify.runtime.balance import (
    MIN_GAIN,
    all_tiles,
    balanced_tiling,
    ring_time,
    tile_costs,
    tile_owners,
)
from ringify.runtime.schedule import shard_tiles
from ringify.testing.attention import document_causal_program, document_ids

PER_CHUNK = 4
# (ring size, document lengths): zigzag leaves these unbalanced at 4 tiles per chunk
UNEVEN = {2: [6, 40, 18], 4: [13, 60, 7, 48]}


def _home(world: int, seq: int, layout: str = "zigzag"):
    return lambda r: shard_tiles(r, world, seq // world, layout, True, PER_CHUNK)


@pytest.mark.parametrize(("world", "layout"), [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_plan_keeps_shapes_and_pays_off(world, layout):
    lengths = UNEVEN[world]
    seq, docs = sum(lengths), document_ids(lengths)
    inputs, program = [docs.view(-1, 1), docs.view(1, -1)], document_causal_program()
    home = _home(world, seq, layout)
    work = balanced_tiling(home, world, program, inputs, seq)
    assert work is not None
    tiles = all_tiles(home, world)
    assert sorted(t.key for t in all_tiles(work, world)) == [t.key for t in tiles]
    for r in range(world):  # same local rows, same sub-ring in each slot: buffers keep shape
        assert [(t.rows, t.sub_ring) for t in work(r)] == [(t.rows, t.sub_ring) for t in home(r)]
        for t in work(r):  # a tile's rows are its global positions' count
            assert t.length == next(h.length for h in tiles if h.key == t.key)
    costs = tile_costs(tiles, program, inputs, seq)
    sub_rings = torch.tensor([t.sub_ring for t in tiles])
    owners = {name: tile_owners(t, tiles, world) for name, t in (("home", home), ("work", work))}
    before, after = (ring_time(costs, owners[n], sub_rings, world) for n in ("home", "work"))
    assert after <= (1 - MIN_GAIN) * before
    busiest = {  # the busiest rank's work
        n: torch.zeros(world, dtype=torch.float64).index_add_(0, o, costs.sum(1)).max()
        for n, o in owners.items()
    }
    assert busiest["work"] < busiest["home"]


def test_one_document_keeps_zigzag():
    """Zigzag already balances one causal document: no plan, nothing moves."""
    seq, docs = 64, torch.zeros(64, dtype=torch.long)
    inputs = [docs.view(-1, 1), docs.view(1, -1)]
    assert balanced_tiling(_home(2, seq), 2, document_causal_program(), inputs, seq) is None


def test_tile_costs_count_what_the_program_leaves_visible():
    """Two documents of one tile each: a tile pair across documents costs nothing, a
    tile with itself its whole area (the bounds cannot see the triangle)."""
    docs = document_ids([8, 8, 8, 8])
    tiles = all_tiles(lambda r: shard_tiles(r, 2, 16, "contiguous", True, 2), 2)
    costs = tile_costs(tiles, document_causal_program(), [docs.view(-1, 1), docs.view(1, -1)], 32)
    assert torch.equal(costs, torch.eye(4, dtype=torch.float64) * 64)


def balanced_ring(world, lengths, learned):
    """The ring op with a document program, balanced and not, vs SDPA on the whole
    sequence: forward, q/k/v gradients and (``learned``) the per-key bias's."""
    import torch.distributed as dist

    from ringify.runtime.p2p import sent_bytes

    seq, docs = sum(lengths), document_ids(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, h, seq, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)
    )
    bias = torch.randn(1, seq, generator=g, dtype=torch.float64)
    visible = (docs.view(-1, 1) == docs.view(1, -1)) & torch.ones(seq, seq).tril().bool()
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
        local = [shard(t, 2, layout="zigzag").requires_grad_() for t in (q, k, v)]
        inputs = [docs.view(-1, 1), docs.view(1, -1)]
        if learned:
            inputs.append(bias.clone().requires_grad_())
        program = document_causal_program(learned)
        before = sent_bytes()
        args = (None, False, 8**-0.5, name, "zigzag", seq, program, inputs, PER_CHUNK, balance)
        out, _ = torch.ops.ringify.ring_attention(*local, *args)
        out.backward(shard(dout, 2, layout="zigzag"))
        got = [out.detach(), *(x.grad for x in local)]
        if learned:  # each rank returns its part; the graph's copy_to_ring sums them
            part = inputs[2].grad.clone()
            dist.all_reduce(part)
            got.append(part)
        results[balance] = (got, sent_bytes() - before)
    if learned:
        expected.append(leaves[3].grad)
    return results, expected


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_balanced_ring_is_exact(ranks, world, learned):
    per_rank = ranks(world).run(balanced_ring, world, UNEVEN[world], learned)
    for results, expected in per_rank:
        for balance in (True, False):
            for got, want in zip(results[balance][0], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the balanced run moved rows: more bytes on some rank than the zigzag run
    assert sum(r[True][1] for r, _ in per_rank) > sum(r[False][1] for r, _ in per_rank)
