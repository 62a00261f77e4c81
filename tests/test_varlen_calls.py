"""Open tile pairs as FlashAttention-2 varlen calls (``ringify/runtime/masks/calls.py``).

FA2 runs only on a GPU, so its documented semantics stand in for it here, written out
independently of the code under test (``fa2_visible``): sequences side by side by
``cu_seqlens``; query j of a sequence of s queries and t keys sees keys
``[j + t - s - left, j + t - s + right]``, -1 leaving a side open. The calls must cover
exactly what each row sees, for every mask whose rows see one run of keys; the ring op on
them (an accelerator's plan, FA2 replaced by that stand-in) must be exact in float64 against
SDPA on the full sequence, forward and backward, in fewer calls; and on meta tensors (CUDA's
branches) every call keeps FA2's contracts.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_flash_contracts import VarlenCalls

from ringify.runtime import shard
from ringify.runtime.attention.blocks import math_backward, math_forward
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.calls import RowSpans, Varlen
from ringify.testing.tolerance import EXACT, relative_difference

N = 40
POS = torch.arange(N)
Q, K = POS.view(-1, 1), POS.view(1, -1)
DOCS = torch.tensor([0] * 7 + [1] * 20 + [2] * 13)
MASKS = {
    "documents": (K <= Q) & (DOCS.view(-1, 1) == DOCS.view(1, -1)),
    "window": (K <= Q) & (Q - K < 5),
    "window, padding keys": (K <= Q) & (Q - K < 5) & (K < 33),
    "window, keys of the tile before": (K <= Q + N) & (Q + N - K < 5),
    "a rectangle": (K >= 10) & (K < 30) & (Q < 12),
    "documents, keys of the tile before": DOCS.view(-1, 1)[:, :1] == DOCS.view(1, -1),
    "both sides": (Q - K).abs() < 4,
    "causal, padding keys": (K <= Q) & (K < 30),
    # most keys padding: the right side as FA2 solves it is wider than the keys
    "causal, mostly padding keys": (K <= Q) & (K < 12),
    "hidden": torch.zeros(N, N, dtype=torch.bool),
}


def fa2_visible(rows: int, keys: int, calls) -> torch.Tensor:
    """(rows, keys) bool: what FA2 lets each query see, by its documented semantics (and its
    ``flash_api.cpp``: a window side as wide as the call's longest keys is no bound, -1)."""
    seen = torch.zeros(rows, keys, dtype=torch.bool)
    for row0, col0, varlen in calls:
        cu_q, cu_k = varlen.cu.tolist()
        left, right = (-1 if w >= varlen.max_keys else w for w in varlen.window)
        for i in range(len(cu_q) - 1):
            s, t = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            for j in range(s):
                first = 0 if left < 0 else max(0, j + t - s - left)
                stop = t if right < 0 else min(t, j + t - s + right + 1)
                seen[row0 + cu_q[i] + j, col0 + cu_k[i] + first : col0 + cu_k[i] + stop] = True
    return seen


def _calls(mask: torch.Tensor, block: int = 16):
    """The pair's varlen calls, its spans gathered block by block as the plan does."""
    spans = RowSpans(mask.shape[0])
    for a in range(0, mask.shape[0], block):
        for b in range(0, mask.shape[1], block):
            part = mask[a : a + block, b : b + block]
            if part.all():
                spans.add_full(slice(a, a + part.shape[0]), slice(b, b + part.shape[1]))
            else:
                additive = torch.zeros(part.shape).masked_fill(~part, float("-inf"))
                spans.add_mask(slice(a, a + part.shape[0]), b, additive.view(1, 1, *part.shape))
    return spans.calls()


@pytest.mark.parametrize("name", list(MASKS))
def test_the_calls_cover_exactly_what_each_row_sees(name):
    mask = MASKS[name]
    calls = _calls(mask)
    assert calls is not None
    got = fa2_visible(*mask.shape, [(c.rows.start, c.cols.start, c.varlen) for c in calls])
    assert torch.equal(got, mask)
    if name == "documents":  # three documents, one call: three causal sequences
        assert len(calls) == 1 and calls[0].varlen.is_causal
        assert calls[0].varlen.cu.tolist() == [[0, 7, 27, 40], [0, 7, 27, 40]]
    if name == "window":  # its first rows cut at the tile's first key: still one call
        assert [c.varlen.window for c in calls] == [(4, 0)]


@pytest.mark.parametrize(
    "mask",
    [(K % 2 == 0) & (K <= Q), DOCS.view(-1, 1) != DOCS.view(1, -1)],
    ids=["every other key", "two runs a row"],
)
def test_rows_that_see_more_than_one_run_of_keys_make_no_calls(mask):
    assert _calls(mask) is None


@pytest.mark.parametrize(("s", "t"), [(8, 8), (8, 5), (8, 4), (8, 3)])
def test_a_causal_call_with_its_padding_keys_cut_off_is_one_sequence_where_fa2_can(s, t):
    """Top-left causal on s rows and t < s keys is FA2's window (-1, s - t), unless that side
    is as wide as the keys (FA2 reads it as no bound): then it stays squared in two calls."""
    from ringify.runtime.masks.calls import Block, as_varlen, sequences_call
    from ringify.runtime.tiling.tiles import Visibility

    got = as_varlen(Block(0, slice(0, s), slice(0, t), Visibility.DIAGONAL, None, None))
    assert (got is None) == (s - t >= t)
    if got is None:  # and no call is made with a window FA2 would widen
        with pytest.raises(AssertionError):
            sequences_call([(0, s, 0, t)], (-1, s - t))
    if got is not None:
        seen = fa2_visible(s, t, [(0, 0, got.varlen)])
        assert torch.equal(seen, torch.ones(s, t, dtype=torch.bool).tril())


def test_a_bias_is_no_window():
    spans = RowSpans(4)
    spans.add_mask(slice(0, 4), 0, torch.full((4, 4), 0.5))
    assert spans.calls() is None


class FA2Kernels:
    """FA2's varlen ATen kernels (``flash.aten``) on (rows, heads, D) tensors, as
    ``fa2_visible`` has them, in float64; each returns dense results, as FA2 allocates them;
    a forward call records its ``Varlen`` in ``calls``."""

    def __init__(self, calls: list | None = None):
        self.calls = [] if calls is None else calls

    def _bias(self, q, k, cu_q, cu_k, max_q, max_k, is_causal, left, right):
        assert cu_q.device == q.device and cu_k.device == q.device
        varlen = Varlen(torch.stack([cu_q, cu_k]), max_q, max_k, (left, 0 if is_causal else right))
        seen = fa2_visible(q.shape[0], k.shape[0], [(0, 0, varlen)])
        assert bool(seen.any(-1).all())  # every row of a call sees a key
        return torch.zeros(seen.shape, dtype=q.dtype).masked_fill(~seen, float("-inf"))

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, _p, is_causal, _dbg,
                                 *, scale, window_size_left, window_size_right):  # fmt: skip
        bias = self._bias(q, k, cu_q, cu_k, max_q, max_k, is_causal, window_size_left,
                          window_size_right)  # fmt: skip
        self.calls.append((cu_q, cu_k, window_size_left, window_size_right))
        b_q, b_k, b_v = (_heads_first(x, q.shape[1]) for x in (q, k, v))
        out, lse = math_forward(b_q, b_k, b_v, is_causal=False, scale=scale, bias=bias)
        return out[0].transpose(0, 1).contiguous(), lse[0].contiguous(), None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, _p,
                                  is_causal, _seed, _offset, *, scale, window_size_left,
                                  window_size_right):  # fmt: skip
        assert lse.is_contiguous()  # FA2 reads it through its data pointer
        bias = self._bias(q, k, cu_q, cu_k, max_q, max_k, is_causal, window_size_left,
                          window_size_right)  # fmt: skip
        grads = math_backward(
            *(_heads_first(x, q.shape[1]) for x in (dout, q, k, v, out)), lse.unsqueeze(0),
            is_causal=False, scale=scale, bias=bias,
        )  # fmt: skip
        dq, dk, dv = (g[0].transpose(0, 1) for g in grads)
        dk, dv = (g.unflatten(1, (k.shape[1], -1)).sum(2) for g in (dk, dv))
        return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(rows, heads, D) as (1, H, rows, D), K/V's heads repeated to q's."""
    return x.transpose(0, 1).unsqueeze(0).repeat_interleave(heads // x.shape[1], dim=1).contiguous()


def varlen_layers(name: str, per_chunk: int = 0):
    """On every rank: the largest relative difference from SDPA of two layers on an
    accelerator's plan with FA2's varlen calls (a stand-in), the varlen calls and all the
    kernel calls of the forwards."""
    import torch.distributed as dist
    from test_accelerator_plan import SEQ, _case

    from ringify.runtime.attention import blocks, flash, ops
    from ringify.runtime.tiling import tiles

    program, inputs, mask = _case(name)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, SEQ, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.5, enable_gqa=True)
    want.backward(full[3])
    expected = [want.detach(), *(x.grad for x in leaves)]
    fa2, kernels, block, varlen = FA2Kernels(), [], ops.block_forward, ops.varlen_forward

    def counted(kernel):
        def call(*args, **kwargs):
            kernels.append(kernel)
            return kernel(*args, **kwargs)

        return call

    group, worst = dist.group.WORLD.group_name, 0.0
    with (
        mock.patch.object(tiles, "on_accelerator", lambda _: True),
        mock.patch.object(blocks, "serves_varlen", lambda q: True),
        mock.patch.object(ops, "block_forward", counted(block)),
        mock.patch.object(ops, "varlen_forward", counted(varlen)),
        mock.patch.object(flash, "aten", fa2),
    ):
        plan = torch.ops.ringify.attention_plan(
            program, inputs, SEQ // 2, False, group, "zigzag", SEQ, per_chunk
        )
        for _ in range(2):  # two layers of one step
            q, k, v = (shard(t, 2, layout="zigzag").requires_grad_() for t in full[:3])
            spec = AttentionSpec(group, 0.5, False, "zigzag", 0.0, program, per_chunk)
            out, _ = torch.ops.ringify.ring_attention(q, k, v, None, inputs, SEQ, spec, plan)
            out.backward(shard(full[3], 2, layout="zigzag"))
            for got, ref in zip((out, q.grad, k.grad, v.grad), expected, strict=True):
                worst = max(
                    worst, relative_difference(got.detach(), shard(ref, 2, layout="zigzag"))
                )
    return worst, len(fa2.calls), len(kernels)


@pytest.mark.parametrize(
    "name",
    # (both at once is each of them again: a long sweep, in the slow pass; the window on
    # varlen calls is also an HF model's test below, in the default pass)
    [
        "packed",
        pytest.param("window", marks=pytest.mark.slow),
        "padded",
        pytest.param("packed, padded", marks=pytest.mark.slow),
    ],
)
def test_a_ring_on_varlen_calls_is_exact(ranks, name):
    """Exact, in no more calls than the blocks make; a pair the blocks run as one unmasked
    call (HF's causal mask with padding: the shard's one causal call per step) stays one,
    a sequence where its padding keys are cut off (FA2's causal is bottom-right)."""
    from test_accelerator_plan import two_layers_on_an_accelerator_plan

    blocks = ranks(2).run(two_layers_on_an_accelerator_plan, name)
    for rank, ((worst, varlen, kernels), (_, _, block_calls, _)) in enumerate(
        zip(ranks(2).run(varlen_layers, name), blocks, strict=True)
    ):
        assert worst <= EXACT, worst
        assert kernels / 2 <= block_calls  # per layer, no more calls than the blocks make
        if name == "padded":  # rank 0's own causal call, its padding keys cut off: one sequence
            assert varlen == (2 if rank == 0 else 0) and kernels / 2 == 2
        else:
            assert varlen > 0  # the open pairs ran as varlen calls
        if name == "window" and rank == 0:  # its own two bands are one call, as is_causal's
            assert kernels / 2 == 2, kernels  # triangles: a call per step


def test_varlen_calls_join_across_tiles_that_travel_apart(ranks):
    """Two tiles per chunk: a sub-ring's tiles are not adjacent rows, so their dK/dV travel
    in a slot each, and a varlen call joined across held tiles adds into both."""
    for worst, varlen, _ in ranks(2).run(varlen_layers, "window", 2):
        assert worst <= EXACT and varlen > 0, (worst, varlen)


@pytest.mark.parametrize("name", ["packed", "window", "causal"])
def test_varlen_calls_keep_fa2s_contracts_on_a_device(name):
    """The ops' bodies on meta tensors (CUDA's branches) with an accelerator's plan (causal:
    its padding keys cut off, one sequence): every varlen call gets its sequences on q's
    device as int32, last-dim-contiguous (rows, heads, D) views, GQA's K/V heads unexpanded,
    a window FA2 takes as given, and (backward) a dense lse."""
    from test_gpu_readiness import GEOMETRY, N, _case, layer_bodies, meta_tensors

    from ringify.runtime.tiling import tiles

    program, host, _ = _case(name)
    inputs = [x.to("meta") for x in host]
    with mock.patch.object(tiles, "on_accelerator", lambda _: True), VarlenCalls() as log:
        plan = torch.ops.ringify.attention_plan(program, host, N, False, *GEOMETRY)
        layer_bodies(program, inputs, plan, *meta_tensors())
    log.check_contracts(heads=(4, 2))
    assert {"forward", "backward"} <= {direction for direction, _ in log.calls}


def hf_model_on_varlen_calls(case: str):
    """On every rank: a ringified HF model (Llama with packed documents, Mistral with a window)
    on an accelerator's plan whose open pairs run as FA2 varlen calls (the stand-in), in
    float64: its logits' and gradients' largest differences from the unmodified model's, and
    its forward's varlen calls."""
    import torch.distributed as dist

    from ringify import ringify
    from ringify.runtime.attention import blocks, flash
    from ringify.runtime.tiling import tiles
    from ringify.testing import hf_models

    torch.manual_seed(0)
    seq = 4096  # zigzag chunks of 1024 rows at 2 ranks: pairs open at documents and windows
    if case == "window":
        model = hf_models.mistral(700, heads=4, kv_heads=2).double()
        kwargs = {}
    else:
        model = hf_models.llama(max_len=seq, heads=4, kv_heads=2).double()
        lengths = (900, 2100, seq - 3000)
        kwargs = {"position_ids": torch.cat([torch.arange(n) for n in lengths]).view(1, -1)}
    ids = torch.randint(1, 64, (1, seq))
    want = model(input_ids=ids, labels=ids, **kwargs)
    want.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    calls: list = []
    with (
        mock.patch.object(tiles, "on_accelerator", lambda _: True),
        mock.patch.object(blocks, "serves_varlen", lambda q: True),
        mock.patch.object(flash, "aten", FA2Kernels(calls)),
    ):
        got = ringify(model, ring_size=dist.get_world_size())(input_ids=ids, labels=ids, **kwargs)
        got.loss.backward()
    grads = max(relative_difference(p.grad, want_grads[n]) for n, p in model.named_parameters())
    return relative_difference(got.logits, want.logits), grads, len(calls)


@pytest.mark.parametrize("case", ["packed", "window"])
def test_an_hf_model_on_varlen_calls_matches_the_unmodified_model(ranks, case):
    for logits, grads, calls in ranks(2).run(hf_model_on_varlen_calls, case):
        assert logits <= EXACT and grads <= EXACT, (logits, grads)
        assert calls > 0


@pytest.mark.parametrize("role", ["q", "k"])
def test_a_program_of_one_sides_positions_makes_calls_over_whole_rows_and_keys(role):
    """A program with no key input (query-side padding: ViT's padded cls sequence) evaluates
    to one broadcast key column, one with no query input to one query row: a plan's calls
    cover every key (or query) the broadcast stands for, not one."""
    from ringify.runtime.masks.program import MaskProgram
    from ringify.runtime.masks.tile_masks import TileMasks
    from ringify.runtime.tiling.tiles import MIN_TILE_ROWS, Tile

    n = 2 * MIN_TILE_ROWS
    program = MaskProgram((role,), (("cast", ({"in": 0},), "bool"),)).text()
    valid = torch.ones(n, dtype=torch.bool)
    valid[-5:] = False  # the last queries (or keys) are padding
    valid = valid.view(-1, 1) if role == "q" else valid.view(1, -1)
    tile = Tile(slice(0, n), (0, 0), 0)
    masks = TileMasks(lambda rank: [tile], 1, None, False, n, program, [valid], varlen=True)
    calls = masks._open_blocks(tile, tile, n)[2]
    mask = valid.expand(n, n)
    got = fa2_visible(n, n, [(c.rows.start, c.cols.start, c.varlen) for c in calls])
    assert torch.equal(got, mask)


def test_the_varlen_wrappers_take_a_models_layout_as_fa2_does():
    """``varlen_forward``/``varlen_backward`` on rows of a model's (B, S, H, D) memory, viewed
    in FA2's layout as the ring views them (``sequence_rows``: from the shard, and from a
    sequence-major buffer as K/V arrive), through FA2's ATen kernels (the stand-in): exact
    against SDPA with the calls' mask in float64; the output comes back in q's dim order
    (the accumulator then takes a whole result as it is: no copy)."""
    from ringify.runtime.attention import flash
    from ringify.runtime.attention.protocol import is_in_dim_order_of
    from ringify.runtime.masks.calls import sequences_call
    from ringify.runtime.tiling.tiles import sequence_rows
    from ringify.testing.ring_vs_sdpa import model_layout

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, 48, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    q, k, v, dout = (model_layout(x) for x in full)
    rows = slice(8, 48)
    arrived = [x.permute(2, 0, 1, 3).contiguous() for x in (k, v)]  # (S, 1, K, D), as K/V travel
    call = sequences_call([(0, 10, 0, 10), (10, 40, 10, 40)], (6, 0))  # two windowed documents
    mask = fa2_visible(40, 40, [(0, 0, call.varlen)])
    leaves = [x.narrow(2, 8, 40).detach().clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.3, enable_gqa=True)
    want.backward(dout.narrow(2, 8, 40))
    seq = lambda x: sequence_rows(x, 8, 40)
    keys = [sequence_rows(x, 8, 40, rows_dim=0) for x in arrived]
    with mock.patch.object(flash, "aten", FA2Kernels()):
        out, lse = flash.varlen_forward(seq(q), *keys, call.varlen, scale=0.3)
        grads = flash.varlen_backward(seq(dout), seq(q), *keys, seq(out_in(q, out, rows)),
                                      lse, call.varlen, scale=0.3)  # fmt: skip
    assert is_in_dim_order_of(q.narrow(2, 8, 40), out)
    assert relative_difference(out, want.detach()) <= EXACT
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.shape == leaf.shape and relative_difference(got, leaf.grad) <= EXACT


def out_in(q: torch.Tensor, out: torch.Tensor, rows: slice) -> torch.Tensor:
    """``out`` (q's ``rows``) written into rows of a tensor laid out as q, as the ring keeps it."""
    whole = torch.zeros_like(q)
    whole.narrow(2, rows.start, rows.stop - rows.start).copy_(out)
    return whole
