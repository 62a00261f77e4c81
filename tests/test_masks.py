"""Masks as programs on real HF models and on the ring op: exact, O(S), and skipping work.

Every HF case runs the ringified model against the unmodified one in float64 (logits,
loss, every parameter gradient) and checks the structure: each attention's mask is a
program and no node of the rewritten graph has a value with two sequence-length dims.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify.passes.graph.report import MaskKind
from ringify.runtime import shard
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.program import MaskProgram, parse
from ringify.runtime.tiling.tiles import Visibility
from ringify.testing.ring_vs_sdpa import window_program
from ringify.testing.tolerance import relative_difference, rounding

S = 24  # per rank; no other dim of the models has this size times the ring size


def hf_case(model_name, case, world, backend=None, window=0):
    import torch.distributed as dist
    from plans_made import made_plans

    from ringify import ringify
    from ringify.testing import hf_models
    from ringify.testing.runs import inductor_control, quadratic_nodes
    from ringify.testing.tolerance import inductor_bound

    torch.manual_seed(0)
    seq = S * world
    if model_name == "mistral":
        model = hf_models.mistral(window).double()
    else:
        model = getattr(hf_models, model_name)(max_len=4 * seq).double()
    ids = torch.randint(1, 64, (2, seq))
    kwargs = {"input_ids": ids, "labels": ids}
    if case in ("right", "left"):
        mask = torch.ones(2, seq, dtype=torch.long)
        if case == "right":
            mask[1, -7:] = 0
        else:
            mask[1, :7] = 0
        kwargs["attention_mask"] = mask
    if case == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in (5, seq - 17, 12)]).expand(
            2, -1
        )

    def step(run):
        model.zero_grad(set_to_none=True)
        out = run(**kwargs)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out.logits.detach(), out.loss.detach(), grads

    def largest(got, want):
        return {
            "logits": (got[0] - want[0]).abs().max().item(),
            "loss": relative_difference(got[1], want[1]),
            "grads": max((got[2][n] - want[2][n]).abs().max().item() for n in want[2]),
        }

    want = step(model)
    control = inductor_control(model, backend)  # Inductor's own move: the bound under it
    own = (
        largest(step(control), want)
        if control is not None
        else dict.fromkeys(("logits", "loss", "grads"), 0)
    )
    ringified = ringify(model, ring_size=dist.get_world_size())
    torch._dynamo.reset()
    run = torch.compile(ringified, backend=backend) if backend else ringified
    with made_plans() as made:
        got = step(run)
    report = ringified.report()
    return {
        **largest(got, want),
        "bounds": {k: inductor_bound(d) for k, d in own.items()},
        "masks": [a.mask for a in report.rewritten],
        "gathers": len(report.gathers),
        "quadratic": quadratic_nodes(ringified, seq),
        "plans": made.counts(),
    }


def check(results, attentions=2):
    for r in results:
        assert r["gathers"] == 0 and r["masks"] == [MaskKind.PROGRAM] * attentions, r
        assert r["quadratic"] == [], r["quadratic"]
        # HF computes the loss in float32: held to float32's own resolution (relative),
        # float64 everywhere else
        assert r["logits"] <= r["bounds"]["logits"] and r["grads"] <= r["bounds"]["grads"], r
        assert r["loss"] <= max(rounding(torch.float32), r["bounds"]["loss"]), r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["plain", "right", "left", "packed"])
def test_llama_masks_are_programs(ranks, world, case):
    results = ranks(world).run(hf_case, "llama", case, world)
    check(results)
    if case == "packed":  # uneven documents: every ring call (2 layers, fwd + bwd) balanced
        assert all(r["plans"] == {"balanced": 4, "kept": 0} for r in results), results


# compiled on 4 ranks: the slow pass (the eager test covers 4 ranks in the default suite)
@pytest.mark.parametrize(
    ("case", "world", "backend"),
    [(c, 2, "aot_eager") for c in ("left", "packed")]
    + [pytest.param(c, 4, "aot_eager", marks=pytest.mark.slow) for c in ("left", "packed")]
    + [("packed", 2, "inductor")],  # the documents' program under Inductor (the slow pass)
)
def test_llama_masks_are_programs_compiled(ranks, world, case, backend):
    results = ranks(world).run(hf_case, "llama", case, world, backend, timeout=900)
    check(results)
    if case == "packed":
        assert all(r["plans"]["balanced"] == 4 for r in results), results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("window", ["smaller", "equal", "not a multiple"])
def test_mistral_sliding_window(ranks, world, window):
    """Windows smaller than, equal to and not a multiple of a rank's chunk (zigzag: S / 2)."""
    chunk = S // 2
    w = {"smaller": chunk // 2, "equal": chunk, "not a multiple": chunk + 5}[window]
    check(ranks(world).run(hf_case, "mistral", "plain", world, False, w))


@pytest.mark.parametrize("world", [2])
def test_mistral_sliding_window_compiled(ranks, world):
    check(ranks(world).run(hf_case, "mistral", "plain", world, "aot_eager", 7))


def test_gpt2_padding_is_a_program(ranks):
    check(ranks(2).run(hf_case, "gpt2", "left", 2))


def user_mask(world):
    """A mask the model is given as an (S, S) tensor: kept whole (the exact path), reported."""
    import torch.distributed as dist

    from ringify import ringify

    class Given(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x, mask):
            q, k, v = (t.view(1, -1, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, -1))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    torch.manual_seed(0)
    model = Given().double()
    seq = S * world
    x = torch.randn(1, seq, 8, dtype=torch.float64)
    mask = torch.rand(seq, seq, generator=torch.Generator().manual_seed(2)) > 0.3
    mask |= torch.eye(seq, dtype=torch.bool)
    want = model(x, mask)
    ringified = ringify(model, ring_size=dist.get_world_size())
    got = ringified(x, mask)
    (row,) = ringified.report().rewritten
    return (got - want).abs().item(), row.mask, row.mask_detail


@pytest.mark.parametrize("world", [2, 4])
def test_a_given_mask_tensor_is_kept_and_said_why(ranks, world):
    for err, kind, detail in ranks(world).run(user_mask, world):
        assert err <= 1e-10 and kind is MaskKind.KEPT
        assert "given" in detail


def windowed_ring(world, layout):
    """The ring op with a window program vs SDPA on the whole sequence; the tile pairs it
    skipped, ran causal, ran unmasked and ran with a bias; the bytes it sent."""
    import torch.distributed as dist

    from ringify.runtime.collectives.ring import SentBytes, resolve_ring
    from ringify.runtime.masks.call_plan import CallGeometry, plan_for

    seq, tiles = 16 * world, 2  # chunks of 16 (contiguous) or 8 (zigzag): tiles of 8 or 4
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    pos = torch.arange(seq)
    mask = ((pos[:, None] - pos[None, :]) >= 0) & ((pos[:, None] - pos[None, :]) < 8)
    leaves = [t.clone().requires_grad_() for t in full]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want.backward(dout)
    q, k, v = (shard(t, 2, layout=layout).requires_grad_() for t in full)
    name = dist.group.WORLD.group_name
    program = window_program(8)
    ring = resolve_ring(None)
    geometry = CallGeometry(ring.name, world, seq // world, False, layout, seq, tiles)
    plan = plan_for(ring, geometry, None, program, [])
    spec = AttentionSpec(name, 8**-0.5, False, layout, 0.0, program, tiles)
    args = (None, [], seq, spec, plan)
    with SentBytes() as sent_forward:
        out, _ = torch.ops.ringify.ring_attention(q, k, v, *args)
    sent = sent_forward.bytes
    counts = plan.tile_counts()
    out.backward(shard(dout, 2, layout=layout))
    grads = [x.grad for x in (q, k, v)]
    expected = [shard(t.detach(), 2, layout=layout) for t in (want, *[x.grad for x in leaves])]
    return out.detach(), grads, counts, sent, expected


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_sliding_window_skips_tiles_and_sends(ranks, world, layout):
    per_rank = ranks(world).run(windowed_ring, world, layout)
    for out, grads, _, _, want in per_rank:
        for got, expected in zip([out, *grads], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    counts = {v: sum(r[2][v] for r in per_rank) for v in Visibility}
    tile = 16 * world // (world * (2 if layout == "zigzag" else 1) * 2)
    grid = 16 * world // tile  # tiles along the sequence; every pair is counted once
    assert sum(counts.values()) == grid * grid
    # a window of 8 keys: each query tile sees its diagonal tile (causal) and, for tiles
    # of 8 rows, the tile before (masked) or, for tiles of 4, the one before (full) and
    # the one before that (masked: keys q - 7 .. q - 4 of it)
    assert counts[Visibility.DIAGONAL] == grid
    if tile == 8:
        assert counts[Visibility.MASKED] == grid - 1 and counts[Visibility.FULL] == 0
    else:
        assert counts[Visibility.FULL] == grid - 1 and counts[Visibility.MASKED] == grid - 2
    assert counts[Visibility.HIDDEN] == grid * grid - sum(
        counts[v] for v in Visibility if v is not Visibility.HIDDEN
    )
    if layout == "contiguous":  # keys go one rank on, not round the ring
        kv_tile = 2 * 2 * tile * 8 * 8  # K and V of one tile, 2 heads, float64
        assert max(r[3] for r in per_rank) <= kv_tile, [r[3] for r in per_rank]


def test_program_text_round_trips_and_refuses_other_ops():
    """The op's argument is the program's content: parsed back it is the same program
    (so equal programs are equal arguments on every rank), and an op with no tile form
    is refused when the text is read."""
    program = parse(window_program(8))
    assert parse(program.text()) == program
    assert parse(program.text()).text() == program.text()
    bad = MaskProgram((), (("mm.default", ({"pos": "q"}, {"pos": "k"}), "int64"),))
    with pytest.raises(ValueError, match="not an elementwise op"):
        parse(bad.text())


def kv_heads_on_the_ring(kv_heads: int):
    """(the K heads of every ring op's k and v, their bytes per step in the report, the
    largest difference of logits and grads from the unmodified model): HF repeats K/V per
    head before SDPA (``repeat_kv``); the ring gets them unrepeated."""
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing import hf_models

    torch.manual_seed(0)
    model = hf_models.llama(heads=4, kv_heads=kv_heads).double()
    ids = torch.randint(1, 64, (2, 16 * dist.get_world_size()))
    want = model(input_ids=ids, labels=ids)
    want.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ringified = ringify(model, ring_size=dist.get_world_size())
    got = ringified(input_ids=ids, labels=ids)
    got.loss.backward()
    graph = next(iter(ringified._traced.values())).module.graph
    rings = [n for n in graph.nodes if n.target is torch.ops.ringify.ring_attention.default]
    heads = sorted({n.args[i].meta["val"].shape[1] for n in rings for i in (1, 2)})
    error = max(
        (got.logits - want.logits).abs().max().item(),
        *((p.grad - want_grads[n]).abs().max().item() for n, p in model.named_parameters()),
    )
    return heads, [a.bytes_per_step for a in ringified.report().attentions], error


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_kv_heads_travel_unexpanded(ranks, world):
    """4 query heads on 1 and 2 kv heads: K/V travel with their own heads (4x and 2x fewer
    bytes than repeated), exactly."""
    for kv_heads in (1, 2):
        for heads, sent, error in ranks(world).run(kv_heads_on_the_ring, kv_heads):
            assert heads == [kv_heads]
            local = 2 * kv_heads * 16 * 8 * 8  # B x K x rows x D x float64
            assert sent == [2 * local] * 2  # k and v, each of 2 layers
            assert error <= 1e-10


def test_a_blocks_padding_keys_are_cut_off_and_its_causal_triangle_kept():
    """An evaluated block: keys no query sees at its end (padding) leave the block, and what
    remains is read as the kernel's top-left causal mask at any shape."""
    from ringify.runtime.masks.open_blocks import classify

    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    padded = tril.clone()
    padded[:, 6:] = False  # 8 queries, 6 real keys: top-left causal on 8 x 6
    assert classify(padded[None, None]) == (Visibility.DIAGONAL, 6, False)
    full = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    full[..., 5:] = False
    assert classify(full) == (Visibility.FULL, 5, False)
    window = tril & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    assert classify(window[None, None]) == (Visibility.MASKED, 8, False)
    rows = torch.stack([padded, tril])[:, None]  # the second batch row has no padding:
    assert classify(rows) == (Visibility.MASKED, 8, False)  # a cut holds for every row, or none
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~padded, float("-inf"))
    assert classify(additive) == (Visibility.DIAGONAL, 6, False)
    assert classify(torch.zeros(1, 1, 8, 8, dtype=torch.bool)) == (Visibility.HIDDEN, 0, True)
    # a query row that sees no key of the block: the kernels' result for it must be zeroed
    empty_row = tril.clone()
    empty_row[3] = False
    assert classify(empty_row[None, None]) == (Visibility.MASKED, 8, True)


def test_an_open_pair_runs_as_few_kernel_calls():
    """HF's causal mask is a program, so a diagonal tile pair is open and cut into blocks: it
    still runs as one causal call, with padding keys at its end cut off; a pair that is not
    the causal triangle runs each row's unmasked blocks as one call."""
    from ringify.runtime.masks.program import MaskProgram
    from ringify.runtime.masks.tile_masks import TileMasks
    from ringify.runtime.tiling.tiles import MIN_TILE_ROWS, Tile

    n = 4 * MIN_TILE_ROWS
    causal = MaskProgram(("q", "k"), (("le.Tensor", ({"in": 1}, {"in": 0}), "bool"),)).text()
    positions = torch.arange(n)
    inputs = [positions.view(-1, 1), positions.view(1, -1)]
    tile = Tile(slice(0, n), (0, 0), 0)
    for key_len, want in ((n, n), (n - 5, n - 5)):
        masks = TileMasks(lambda rank: [tile], 1, None, False, key_len, causal, inputs)
        blocks, coalesced, _ = masks._open_blocks(tile, tile, min(n, key_len))
        assert len(blocks) == 16
        assert [(b[0], b[1], b[2]) for b in coalesced] == [
            (slice(0, n), slice(0, want), Visibility.DIAGONAL)
        ]
    # HF's right padding, over a block and a half: its hidden key blocks are left out too
    padded = MaskProgram(
        ("k",),
        (
            ("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),
            ("__and__.Tensor", ({"op": 0}, {"in": 0}), "bool"),
        ),
    ).text()
    valid = n - MIN_TILE_ROWS - MIN_TILE_ROWS // 2
    masks = TileMasks(
        lambda rank: [tile], 1, None, False, n, padded, [positions.view(1, -1) < valid]
    )
    _, coalesced, _ = masks._open_blocks(tile, tile, n)
    assert [(b[0], b[1], b[2]) for b in coalesced] == [
        (slice(0, n), slice(0, valid), Visibility.DIAGONAL)
    ]
    window = MaskProgram(
        ("q", "k"),
        (
            ("le.Tensor", ({"in": 1}, {"in": 0}), "bool"),
            ("sub.Tensor", ({"in": 0}, {"in": 1}), "int64"),
            ("lt.Scalar", ({"op": 1}, 3 * MIN_TILE_ROWS), "bool"),
            ("__and__.Tensor", ({"op": 0}, {"op": 2}), "bool"),
        ),
    ).text()
    n = 6 * MIN_TILE_ROWS  # the last rows: a masked block, then two unmasked, the diagonal
    tile, positions = Tile(slice(0, n), (0, 0), 0), torch.arange(n)
    inputs = [positions.view(-1, 1), positions.view(1, -1)]
    masks = TileMasks(lambda rank: [tile], 1, None, False, n, window, inputs)
    blocks, coalesced, _ = masks._open_blocks(tile, tile, n)
    seen = [b[2] for b in coalesced if b[2] is not Visibility.HIDDEN]
    assert len(seen) < sum(b[2] is not Visibility.HIDDEN for b in blocks)
    assert Visibility.MASKED in seen  # the window's edge keeps its mask


def test_a_program_of_query_positions_only_keeps_every_key():
    """A program with no key input (a query-side padding mask) evaluates to one key column,
    broadcast: a block is never cut to that column (ViT's padded cls sequence)."""
    from ringify.runtime.masks.program import MaskProgram
    from ringify.runtime.masks.tile_masks import TileMasks
    from ringify.runtime.tiling.tiles import MIN_TILE_ROWS, Tile

    n = 2 * MIN_TILE_ROWS
    program = MaskProgram(("q",), (("cast", ({"in": 0},), "bool"),)).text()
    valid = torch.ones(n, 1, dtype=torch.bool)
    valid[-5:] = False  # the last queries are padding
    tile = Tile(slice(0, n), (0, 0), 0)
    masks = TileMasks(lambda rank: [tile], 1, None, False, n, program, [valid])
    blocks, _, _ = masks._open_blocks(tile, tile, n)
    masked = [b for b in blocks if b[2] is Visibility.MASKED]
    assert masked and all(b[1].stop - b[1].start == MIN_TILE_ROWS for b in masked), blocks
