"""The custom ops under torch.library.opcheck, gradcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime import gather, ring_attention, shard
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.collectives.layout import unshard
from ringify.runtime.collectives.ring import ring_by_name
from ringify.runtime.tiling import tiles
from ringify.testing import RankPool
from ringify.testing.ring_vs_sdpa import model_layout


def ring_args(seq, *, layout="zigzag", dtype=torch.float64, seed=0):
    """q, k, v (requires_grad) of this rank's shard, and the group name the ops take."""
    import torch.distributed as dist

    from ringify.runtime.collectives.ring import resolve_ring

    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(2, h, seq, 8, generator=g, dtype=dtype) for h in (4, 2, 2)]
    group = dist.group.WORLD if dist.is_initialized() else None
    local = [shard(t, 2, layout=layout).clone().requires_grad_() for t in full]
    return local, resolve_ring(group).name


def as_model_layout(t):
    """The same values laid out as a model's (``model_layout``), a leaf that needs its grad."""
    return model_layout(t.detach()).requires_grad_()


def opcheck_ops():
    """opcheck every op (every rank runs the same sequence of calls, so the ring stays in
    step): the ring's attention, dilated attention, gather and take_shard, to_dim and
    from_dim, then the ops beside them."""
    qkv, name = ring_args(16)
    strided = [as_model_layout(t) for t in qkv]
    for is_causal, (q, k, v) in [(False, qkv), (True, qkv), (True, strided)]:
        spec = AttentionSpec(name, 0.3, is_causal, "zigzag", tiles_per_chunk=2)
        args = (q, k, v, None, [], q.shape[2] * 2, spec)
        torch.library.opcheck(torch.ops.ringify.ring_attention.default, args)
        out, lse = torch.ops.ringify.ring_attention(*args)
        # The backward op is not differentiable itself (no double backward): plain tensors.
        tensors = (torch.randn_like(out), q, k, v, out, lse)
        bwd_args = (*(t.detach() for t in tensors), *args[3:])
        torch.library.opcheck(torch.ops.ringify.ring_attention_backward.default, bwd_args)
    # The dilated op: a segment inside each rank's chunk and one spanning the ring.
    (q, k, v), _ = ring_args(16, layout="contiguous")
    k, v = (x.detach().repeat_interleave(2, dim=1).requires_grad_() for x in (k, v))
    for is_causal in (False, True):
        dilated = AttentionSpec.dilated(name, 0.3, is_causal, Dilation((4, 16), (2, 2)))
        args = (q, k, v, None, [], q.shape[2] * 2, dilated)
        torch.library.opcheck(torch.ops.ringify.dilated_attention.default, args)
        out, lse = torch.ops.ringify.dilated_attention(*args)
        tensors = (torch.randn_like(out), q, k, v, out, lse)
        bwd_args = (*(t.detach() for t in tensors), *args[3:])
        torch.library.opcheck(torch.ops.ringify.dilated_attention_backward.default, bwd_args)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.ringify.gather.default, (x, 1, name, "zigzag"))
    strided = torch.randn(4, 3, dtype=torch.float64).t()
    torch.library.opcheck(torch.ops.ringify.gather.default, (strided, 1, name, "zigzag"))
    # the padding cut off by the op (a lifted graph's gather: a length read at run time)
    torch.library.opcheck(torch.ops.ringify.gather.default, (x, 1, name, "zigzag", 3))
    full = torch.randn(3, 8, dtype=torch.float64)
    torch.library.opcheck(torch.ops.ringify.take_shard.default, (full, 1, name, "zigzag"))
    # between the sequence and a share of another dim (4 positions a rank, 4 channels)
    size = ring_by_name(name).size
    local = torch.randn(2, 4, 4, 3, dtype=torch.float64, requires_grad=True)
    args = (local, 1, 2, name, "zigzag", 4 * size - 1)  # the padding cut off
    torch.library.opcheck(torch.ops.ringify.to_dim.default, args)
    share = torch.ops.ringify.to_dim(*args).detach().requires_grad_(True)
    back = (share, 1, 2, name, "zigzag", 4 * size, -1.0)
    torch.library.opcheck(torch.ops.ringify.from_dim.default, back)
    opcheck_beside_the_ring(name)
    return True


def opcheck_beside_the_ring(name: str) -> None:
    """The ops that serve the ring: memory attention (replicated queries, this rank's keys;
    with and without a learned bias), a mask program and its plan, a decode step's attention,
    joint attention (image and text queries), the ring's maximum, sequence dropout, and
    tensor parallelism's collectives."""
    import torch.distributed as dist

    from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs

    (q, k, v), _ = ring_args(16, layout="contiguous")
    q = q[:, :, :3].detach().requires_grad_()  # a short replicated query set
    k, v = (x.detach().repeat_interleave(2, dim=1).requires_grad_() for x in (k, v))
    bias = torch.randn(1, 4, 3, k.shape[2], dtype=q.dtype, requires_grad=True)
    for mask in (None, bias):
        args = (q, k, v, mask, [], 15, AttentionSpec(name, 0.3))
        torch.library.opcheck(torch.ops.ringify.memory_attention.default, args)
        out, lse = torch.ops.ringify.memory_attention(*args)
        tensors = (torch.randn_like(out), q, k, v, out, lse)
        plain_mask = None if mask is None else mask.detach()
        bwd_args = (*(t.detach() for t in tensors), plain_mask, *args[4:])
        kwargs = {"mask_grad": mask is not None}
        op = torch.ops.ringify.memory_attention_backward.default
        torch.library.opcheck(op, bwd_args, kwargs)
    program = document_causal_program()
    inputs = document_inputs([5, 3, 8])
    shape = [2, 1, 16, 16]
    torch.library.opcheck(
        torch.ops.ringify.program_mask.default, (program, inputs, shape, torch.device("cpu"))
    )
    rows = 16 // (dist.get_world_size() if dist.is_initialized() else 1)
    plan_args = (program, inputs, rows, True, name, "zigzag", 16)
    # its output is a plan, not a tensor: AOT dispatch's check compares tensors alone
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.ringify.attention_plan.default, plan_args, test_utils=checks)
    torch.library.opcheck(torch.ops.ringify.host_inputs.default, (inputs,))
    with mock.patch.object(tiles, "on_accelerator", lambda device_type: True):  # laid out
        plan = torch.ops.ringify.attention_plan(*plan_args)
        for dtype in (torch.float64, torch.bfloat16):
            args = (inputs, plan, dtype, False, torch.device("cpu"), rows)
            torch.library.opcheck(torch.ops.ringify.step_masks.default, args, test_utils=checks)
    g = torch.Generator().manual_seed(0)
    q, k, v, k_new, v_new = (
        torch.randn(2, heads, rows, 4, generator=g, dtype=torch.float64)
        for heads, rows in ((8, 1), (2, 5), (2, 5), (2, 1), (2, 1))
    )
    keep = torch.rand(2, 1, 1, 6, generator=g) > 0.3
    for key_len in (5, 6):  # a decode step over this rank's cache part, and the new key
        args = (q, k, v, keep, [k_new, v_new], key_len, AttentionSpec(name, 0.5))
        torch.library.opcheck(torch.ops.ringify.decode_attention.default, args)
    sinks = torch.randn(1, 8, 1, 1, generator=g, dtype=torch.float64)  # and soft-capped
    args = (q, k, v, keep, [k_new, v_new], 6, AttentionSpec(name, 0.5, softcap=2.0), None, sinks)
    torch.library.opcheck(torch.ops.ringify.decode_attention.default, args)
    (q, k, v), _ = ring_args(16)
    k, v = (t.detach().repeat_interleave(2, dim=1).requires_grad_() for t in (k, v))
    k_text, v_text = (torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64) for _ in "kv")
    q_text = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward"):  # generate's: no gradients
        torch.ops.ringify.decode_attention_backward.default(q, q, k, v, q, q[..., 0], *args[3:])
    text = [k_text.requires_grad_(), v_text.requires_grad_()]
    spec = AttentionSpec(name, 0.3, layout="zigzag")
    joint = torch.ops.ringify.joint_attention, torch.ops.ringify.joint_attention_backward
    memory = (
        torch.ops.ringify.joint_memory_attention, torch.ops.ringify.joint_memory_attention_backward
    )  # fmt: skip
    for queries, (op, backward) in ((q, joint), (q_text, memory)):  # image, then text queries
        args = (queries, k, v, None, text, q.shape[2] * 2, spec)
        torch.library.opcheck(op.default, args)
        out, lse = op(*args)
        tensors = (torch.randn_like(out), *args[:3], out, lse)
        bwd_args = (*(t.detach() for t in tensors), None, [t.detach() for t in text], *args[5:])
        torch.library.opcheck(backward.default, bwd_args, {"input_grads": [True, True]})
    x = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.ringify.with_zero_grads.default, (x, [q_text]))
    torch.library.opcheck(torch.ops.ringify.sequence_dropout.default, (x, 0.25, name))
    a, b = (torch.rand(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in "ab")
    c = torch.randn(2, 7, 4, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    for scan in ((a, b, c, None), (a, b, c, h0), (a, b, None, h0)):  # Mamba-1's scan
        scan = [t if t is None else t.requires_grad_() for t in scan]
        args = (*scan, torch.float64, torch.float64)
        torch.library.opcheck(torch.ops.ringify.selective_scan.default, args)
    logits = torch.randn(12, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for largest in (True, False):  # a router's top-k, its backward opaque to Inductor
        torch.library.opcheck(torch.ops.ringify.topk.default, (logits, 2, 1, largest, True))
    _, chosen = logits.detach().topk(2, 1)
    grad = torch.randn(12, 2, generator=g, dtype=torch.float64)
    torch.library.opcheck(torch.ops.ringify.topk_backward.default, (grad, chosen, [12, 5], 1))
    if name:  # a ring's maximum needs a ring: checked on 2 ranks
        torch.library.opcheck(torch.ops.ringify.ring_amax.default, (x, [1], name))
        # tensor parallelism's collectives, over the ring's group taken as a TP group
        x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
        torch.library.opcheck(torch.ops.ringify.tp_copy.default, (x, name))
        torch.library.opcheck(torch.ops.ringify.tp_reduce.default, (x, name))
        torch.library.opcheck(torch.ops.ringify.tp_gather.default, (x, name))
        torch.library.opcheck(torch.ops.ringify.tp_split.default, (x, name))
        rows = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)  # of a vocab of 10
        ids = torch.randint(0, 10, (2, 6), generator=g)
        args = (rows, ids, 10, 3, name)
        torch.library.opcheck(torch.ops.ringify.tp_vocab_embedding.default, args)


def gradcheck_ring():
    (q, k, v), _ = ring_args(8, seed=1)  # the local op: torch.distributed is not initialised
    fn = lambda q, k, v: ring_attention(q, k, v, is_causal=True, enable_gqa=True, layout="zigzag")
    return torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(ranks, world):
    assert opcheck_ops() if world == 1 else all(ranks(world).run(opcheck_ops))


def test_gradcheck():
    # Single process only: on a ring, a rank's dk/dv hold the gradient of every
    # rank's output, which no local finite difference sees. Multi-rank gradients
    # are compared with full-sequence SDPA in test_ring_attention.py.
    assert gradcheck_ring()


def eager_and_compiled(backend):
    """ring_attention then gather, eager and compiled with fullgraph=True; local results."""
    import torch._dynamo

    torch._dynamo.reset()
    (q, k, v), _ = ring_args(16)  # float64: compiled and eager agree to rounding on any CPU

    def attend(q, k, v):
        out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, layout="zigzag")
        return gather(out, 2, layout="zigzag").square().sum()

    results = []
    for fn in (attend, torch.compile(attend, backend=backend, fullgraph=True)):
        loss = fn(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        results.append([loss.detach(), *grads])
    return results


@pytest.mark.parametrize(
    ("world", "backend"),
    [(1, "aot_eager"), (2, "aot_eager")],  # Inductor: every model case
)
def test_compiled_matches_eager(ranks, world, backend):
    per_rank = (
        [eager_and_compiled(backend)]
        if world == 1
        else ranks(world).run(eager_and_compiled, backend)
    )
    for eager, compiled in per_rank:
        for e, c in zip(eager, compiled, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-10, atol=1e-10)


@pytest.mark.slow  # two pools compile with Inductor
def test_warm_compile_cache_serves_every_rank_its_own_graph(tmp_path):
    """Fresh ranks meeting a compile cache that other ranks filled still compute their own part.

    The on-disk caches are shared by every rank of a machine and keyed by the
    forward graph; anything rank-dependent baked in while tracing (such as the
    rank in gather's backward) would be served to the wrong rank.
    """
    for _ in range(2):  # the first pair of ranks fills the cache, the second reads it
        pool = RankPool(2, inductor_cache=str(tmp_path))  # one cache for both ranks
        try:
            per_rank = pool.run(eager_and_compiled, "inductor")
        finally:
            pool.close()
        for eager, compiled in per_rank:
            for e, c in zip(eager, compiled, strict=True):
                torch.testing.assert_close(c, e, rtol=1e-10, atol=1e-10)


def compiled_graph_has_one_ring_node():
    """The op is one opaque node for AOTAutograd: exactly one forward and one backward call."""
    import torch._dynamo
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    (q, k, v), _ = ring_args(16, dtype=torch.float32)
    backend = AotEagerAndRecordGraphs()
    fn = torch.compile(
        lambda q, k, v: ring_attention(q, k, v, enable_gqa=True), backend=backend, fullgraph=True
    )
    fn(q, k, v).sum().backward()
    count = lambda graphs, op: sum(n.target is op for g in graphs for n in g.graph.nodes)
    return (
        count(backend.fw_graphs, torch.ops.ringify.ring_attention.default),
        count(backend.bw_graphs, torch.ops.ringify.ring_attention_backward.default),
    )


def test_compiled_graph_has_one_ring_node(ranks):
    assert ranks(2).run(compiled_graph_has_one_ring_node) == [(1, 1), (1, 1)]


def shard_gather_roundtrip(layout):
    x = torch.arange(2 * 24, dtype=torch.float64).view(2, 24).requires_grad_()
    part = shard(x, 1, layout=layout)
    full = gather(part * 1.0, 1, layout=layout)
    (full * torch.arange(24.0, dtype=torch.float64)).sum().backward()
    return part.detach(), full.detach(), x.grad


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_shard_and_gather(ranks, world, layout):
    x = torch.arange(2 * 24, dtype=torch.float64).view(2, 24)
    chunks = x.chunk(world * (2 if layout == "zigzag" else 1), dim=1)
    per_rank = ranks(world).run(shard_gather_roundtrip, layout)
    for rank, (part, full, grad) in enumerate(per_rank):
        own = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
        assert torch.equal(part, torch.cat([chunks[i] for i in own], 1))
        assert torch.equal(full, x)
        # gather's backward is this rank's slice of the incoming gradient; shard's
        # backward scatters it back to this rank's positions.
        weights = torch.arange(24.0, dtype=torch.float64).expand(2, 24)
        expected = torch.zeros_like(x)
        mask = torch.zeros(24, dtype=torch.bool)
        for i in own:
            mask[i * chunks[0].shape[1] : (i + 1) * chunks[0].shape[1]] = True
        expected[:, mask] = weights[:, mask]
        assert torch.equal(grad, expected)
    assert torch.equal(unshard([p for p, _, _ in per_rank], 1, layout), x)


def group_of_one_rank():
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    (q, k, v), _ = ring_args(16, layout="contiguous")
    own = groups[dist.get_rank()]
    out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, group=own)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return (out - ref).abs().max().item()


def test_group_of_one_rank_is_local_attention(ranks):
    assert ranks(2).run(group_of_one_rank) == [0.0, 0.0]


def ring_amax_matches_torch(layout):
    """ring_amax against torch.amax on the full tensor: ties shared across ranks, inf, NaN."""
    import torch.distributed as dist

    from ringify.runtime.collectives.reduce import ring_amax

    name = dist.group.WORLD.group_name
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, 4, (3, 8 * world, 2), generator=g).double()  # many ties
    full[1, 5, 0] = float("inf")
    full[2, -1, 1] = float("nan")
    results = []
    for dims in ([1], [0, 1], [1, 2]):
        x = full.clone().requires_grad_()
        want = x.amax(dims, keepdim=True)
        want.backward(torch.arange(want.numel(), dtype=torch.float64).view_as(want) + 1)
        part = shard(full, 1, layout=layout).requires_grad_()
        got = ring_amax(part, dims, name)
        got.backward(torch.arange(got.numel(), dtype=torch.float64).view_as(got) + 1)
        results.append(
            (
                torch.equal(got.detach().nan_to_num(7.0), want.detach().nan_to_num(7.0)),
                torch.allclose(part.grad, shard(x.grad, 1, layout=layout), equal_nan=True),
            )
        )
    return results


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_amax_shares_the_gradient_of_ties_across_ranks(ranks, world, layout):
    for per_rank in ranks(world).run(ring_amax_matches_torch, layout):
        assert per_rank == [(True, True)] * 3


def ring_argmax_matches_torch(layout):
    """ring_argmax against torch.argmax on the full tensor: the first of ties across ranks, NaN."""
    import torch.distributed as dist

    from ringify.runtime.collectives.reduce import ring_argmax

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, 3, (4, 8 * world), generator=g).double()  # many ties
    full[1, 6] = float("nan")
    full[2, -1] = float("inf")
    want = full.argmax(1, keepdim=True)
    part = shard(full, 1, layout=layout)
    got = ring_argmax(part, 1, 8 * world, dist.group.WORLD.group_name, layout)
    return torch.equal(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_argmax_is_the_first_maximum_over_the_ring(ranks, world, layout):
    assert all(ranks(world).run(ring_argmax_matches_torch, layout))


def _real_part(full, pad, real, layout):
    """This rank's part of ``full`` padded with ``pad``, without the padding's positions."""
    return shard(torch.cat([full, pad], 1), 1, layout=layout)[:, real]


def ring_shift_matches_shifted(layout):
    """ring_shift of each rank's part against ``shifted`` of the full sequence, values and
    gradients, shifts both ways, scalar and start-token fills, a padded sequence."""
    import torch.distributed as dist

    from ringify.runtime.collectives.neighbours import ring_shift, shifted

    name = dist.group.WORLD.group_name
    world = dist.get_world_size()
    padded = 6 * world * 2
    g = torch.Generator().manual_seed(0)
    results = []
    for length in (padded, padded - 3):
        full = torch.randn(2, length, 3, generator=g, dtype=torch.float64)
        start = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
        for shift, fill in ((1, -100.0), (2, 0.0), (-1, start[:, :1]), (-2, start), (-3, 5.0)):
            x = full.clone().requires_grad_()
            want = shifted(x, 1, shift, fill)
            seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
            want.backward(seed)
            pad = torch.zeros(2, padded - length, 3, dtype=torch.float64)
            part = shard(torch.cat([full, pad], 1), 1, layout=layout).requires_grad_()
            got = ring_shift(part, 1, shift, fill, padded, length, name, layout)
            got.backward(shard(torch.cat([seed, pad], 1), 1, layout=layout))
            real = shard(torch.arange(padded) < length, 0, layout=layout)
            results.append(
                torch.equal(got.detach()[:, real], _real_part(want.detach(), pad, real, layout))
                and torch.allclose(part.grad[:, real], _real_part(x.grad, pad, real, layout))
            )
    return results


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_shift_is_shifted_on_the_full_sequence(ranks, world, layout):
    for per_rank in ranks(world).run(ring_shift_matches_shifted, layout):
        assert per_rank == [True] * 10


def test_every_op_is_opchecked():
    """opcheck_ops covers every op ringify registers (31): a new op must join it."""
    import inspect
    import re

    import ringify  # noqa: F401  (registers every op the pass writes)

    registered = {
        name
        for name in dir(torch.ops.ringify)
        if isinstance(getattr(torch.ops.ringify, name), torch._ops.OpOverloadPacket)
    }
    source = inspect.getsource(opcheck_ops) + inspect.getsource(opcheck_beside_the_ring)
    checked = {name for name in registered if re.search(rf"torch\.ops\.ringify\.{name}\b", source)}
    assert len(registered) == 31 and checked == registered, registered - checked


def test_a_routers_topk_is_its_own_op_with_the_same_gradient():
    """``opaque_topks``: a top-k whose values are read becomes ``ringify::topk`` (its backward
    one kernel Inductor cannot misorder, ``docs/inductor_scatter.md``); one whose indices
    alone are read stays. Outputs and gradients are torch.topk's."""
    from ringify.runtime.topk import opaque_topks

    class Router(torch.nn.Module):
        def forward(self, logits):
            gates, chosen = logits.topk(2, -1)
            counted = logits.softmax(-1).topk(2, dim=1, largest=False)[1]  # indices only
            return gates.softmax(-1) * chosen + counted

    logits = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    gm = torch.export.export(Router(), (logits,), strict=False).module()
    assert opaque_topks(gm) == 1
    targets = [n.target for n in gm.graph.nodes if "topk" in str(n.target)]
    assert targets == [torch.ops.ringify.topk.default, torch.ops.aten.topk.default]
    want = Router()(logits)
    (grad,) = torch.autograd.grad(want.square().sum(), logits)
    got = gm(logits)
    (got_grad,) = torch.autograd.grad(got.square().sum(), logits)
    assert torch.equal(got, want) and torch.equal(got_grad, grad)
