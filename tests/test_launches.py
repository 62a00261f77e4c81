"""For a given plan, the ring op issues the same kernels and transfers, with the same shapes,
on every call after the first, whatever the values of q, k and v: what CUDA-graph capture
needs (``torch.compile(mode="reduce-overhead")`` warms up, then records). The first call of a
plan also works out each step's blocks on the host and keeps them on the plan. Given the
step's masks (``ringify::step_masks``), a call recorded into a CUDA graph launches what an
eager one does, FA2 varlen calls included, and evaluates no mask. Held on CPU:
every op the forward and backward bodies dispatch (kernels, views, P2P sends and receives) is
recorded with its arguments' shapes, dtypes and strides, for two calls on the same plan with
different q, k and v, on 2 gloo ranks, for a causal, a right-padded, a packed-document and a
sliding-window program. None reads a value to the host (``_local_scalar_dense``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.program import MaskProgram
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs, window_program

ROWS = 48  # per rank, in tiles of 12 (tiles_per_chunk 2 under zigzag)
CAUSAL = (("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),)
# right padding: causal, and the key a real token (input 0, along keys)
PADDED = (*CAUSAL, ("__and__.Tensor", ({"op": 0}, {"in": 0}), "bool"))


class Launches(TorchDispatchMode):
    """Every op dispatched inside, with what its tensor arguments look like."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        looks = tuple(
            (tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else None
            for x in tree_leaves((args, kwargs))
        )
        self.calls.append((str(func), looks))
        return func(*args, **kwargs)


def three_calls(name: str, new_plan_after_first: bool = False, given: bool = False):
    """The launch sequences of three forward-and-backward calls on one plan (or on a second
    plan of the same mask after the first call: its host answers made), and how many ring
    calls ran on the last plan. ``given``: each plan's step masks are made, outside the
    calls, and given to them."""
    import torch.distributed as dist

    seq = ROWS * dist.get_world_size()
    if name == "packed":
        program, inputs = document_causal_program(), document_inputs([30, seq - 50, 20])
    elif name == "padded":  # the last tenth of the keys is padding
        program = MaskProgram(("k",), PADDED).text()
        inputs = [(torch.arange(seq) < seq - seq // 10).view(1, -1)]
    else:
        program = MaskProgram((), CAUSAL).text() if name == "causal" else window_program(20)
        inputs = []
    geometry = (dist.group.WORLD.group_name, "zigzag", seq)
    plan = torch.ops.ringify.attention_plan(program, inputs, ROWS, False, *geometry, 2)
    sequences = []
    for seed in (0, 1, 2):
        if seed == 1 and new_plan_after_first:
            plan = torch.ops.ringify.attention_plan(program, inputs, ROWS, False, *geometry, 2)
        g = torch.Generator().manual_seed(seed + 10 * dist.get_rank())
        q, k, v, dout = (torch.randn(2, 4, ROWS, 8, generator=g) for _ in range(4))
        k, v = k[:, :2], v[:, :2]  # GQA: 2 kv heads
        name, layout, key_len = geometry
        spec = AttentionSpec(name, 0.35, False, layout, 0.0, program, 2)
        step_masks = None
        if given:
            made = torch.ops.ringify.step_masks(inputs, plan, q.dtype, False, q.device, ROWS)
            step_masks = list(made)
        args = (None, inputs, key_len, spec, plan, None, step_masks)
        with Launches() as launches:  # the ops' bodies: a mode sees a custom op as one op
            out, lse = ring_attention_op._init_fn(q, k, v, *args)
            ring_attention_backward_op._init_fn(dout, q, k, v, out, lse, *args)
        sequences.append(launches.calls)
    return sequences, plan.calls.total()


@pytest.mark.parametrize("name", ["causal", "padded", "packed", "window"])
def test_a_plan_launches_the_same_on_every_call(ranks, name):
    for (_, first, second), calls in ranks(2).run(three_calls, name):
        assert calls == 6  # three forward, three backward calls, all on the plan given
        assert first == second
        ops = {op for op, _ in first}
        assert any("send" in op for op in ops) and any("recv" in op for op in ops), ops
        assert not any("_local_scalar_dense" in op for op in ops)


def recorded_calls(name: str):
    """``three_calls``, each recorded into a CUDA graph (the ops told so: this CPU has none),
    with a GPU's tiles and the step's masks given; and how many masks the calls evaluated."""
    from unittest import mock

    from ringify.runtime.attention import ops
    from ringify.runtime.masks import captures, tile_masks
    from ringify.runtime.tiling import tiles

    evaluated = []

    def evaluate(*args):  # by a call, on its device
        evaluated.append(args[2:4])
        return call_masks_evaluate(*args)

    call_masks_evaluate = tile_masks.evaluate
    with (
        mock.patch.object(ops, "capturing", lambda device: True),
        mock.patch.object(tiles, "on_accelerator", lambda device_type: True),
        mock.patch.object(tile_masks, "evaluate", evaluate),
        mock.patch.dict(captures._captured, clear=True),
    ):
        return three_calls(name, new_plan_after_first=True, given=True), len(evaluated)


@pytest.mark.parametrize("name", ["padded", "packed", "window"])
def test_a_recorded_call_launches_the_same_from_the_first(ranks, name):
    """Given the step's masks, a call being recorded evaluates none of them (a plan's first
    call launches what its next does, once the host has worked out the steps: the first
    plan's call), and reads nothing on the host."""
    for ((_, first, second), calls), evaluated in ranks(2).run(recorded_calls, name):
        assert calls == 4
        assert first == second
        assert evaluated == 0
        assert not any("_local_scalar_dense" in op for op, _ in first)


def varlen_blocks_recorded(given: bool) -> tuple[int, int]:
    """A packed plan with a GPU's tiles and FA2 varlen calls, one call being recorded into a
    CUDA graph: how many of its blocks are varlen calls, and how many of their sequences are
    views of the step's masks (``given``) rather than copies."""
    from unittest import mock

    import torch.distributed as dist

    from ringify.runtime.tiling import tiles
    from ringify.runtime.tiling.tiles import sub_ring, sub_rings

    seq = 4096 * dist.get_world_size()
    program, inputs = document_causal_program(), document_inputs([1500, seq - 2600, 1100])
    geometry = (dist.group.WORLD.group_name, "zigzag", seq)
    with mock.patch.object(tiles, "on_accelerator", lambda device_type: True):
        plan = torch.ops.ringify.attention_plan(program, inputs, 4096, False, *geometry)
        cpu = torch.device("cpu")
        made = torch.ops.ringify.step_masks(inputs, plan, torch.bfloat16, True, cpu, 4096)
        step_masks = list(made) if given else None
        masks = plan.bound_masks(
            inputs, torch.device("cpu"), torch.bfloat16, True, step_masks, True
        )
        rank, varlen, views = dist.get_rank(), 0, 0
        mine, own = plan.queries(rank), sub_rings(plan.home, rank)[0]
        for s in range(dist.get_world_size()):
            held = sub_ring(plan.home, (rank - s) % dist.get_world_size(), 0).tiles
            joinable = s > 0 or own.adjacent  # as the ring's visits hold them
            for b in masks.pairs(mine, held, joinable=joinable):
                if b.varlen is not None:
                    varlen += 1
                    views += b.varlen.cu.untyped_storage().data_ptr() == made[1].data_ptr()
    return varlen, views


def test_a_recorded_call_runs_varlen_calls_on_the_step_masks(ranks):
    """A recorded call cannot copy varlen sequences from the host: given the step's masks,
    it runs FA2 varlen calls on views of them; without, none."""
    for varlen, views in ranks(2).run(varlen_blocks_recorded, True):
        assert varlen > 0 and views == varlen
    assert ranks(2).run(varlen_blocks_recorded, False) == [(0, 0), (0, 0)]
