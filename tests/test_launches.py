"""For a given plan, the ring op issues the same kernels and transfers, with the same shapes,
on every call after the first, whatever the values of q, k and v: what CUDA-graph capture
needs (``torch.compile(mode="reduce-overhead")`` warms up, then records). The first call of a
plan also works out each step's blocks on the host and keeps them on the plan. Held on CPU:
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
from ringify.testing.attention import document_causal_program, document_inputs, window_program

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


def three_calls(name: str, new_plan_after_first: bool = False):
    """The launch sequences of three forward-and-backward calls on one plan (or on a second
    plan of the same mask after the first call: its host answers made, nothing kept), and
    how many ring calls ran on the last plan."""
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
        args = (None, inputs, key_len, spec, plan)
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
    with a GPU's tiles, kept masks and FA2 varlen calls (which this CPU cannot run)."""
    from unittest import mock

    from ringify.runtime.attention import ops
    from ringify.runtime.masks import captures
    from ringify.runtime.tiling import tiles

    with (
        mock.patch.object(ops, "capturing", lambda device: True),
        mock.patch.object(ops, "serves_varlen", lambda q: True),
        mock.patch.object(tiles, "on_accelerator", lambda device_type: True),
        mock.patch.dict(captures._captured, clear=True),
    ):
        return three_calls(name, new_plan_after_first=True)


@pytest.mark.parametrize("name", ["padded", "packed"])
def test_a_recorded_call_launches_the_same_from_the_first(ranks, name):
    """A call being recorded keeps no mask for the next (a graph's memory is its own), so a
    plan's first call launches what its next does (once the host has worked out the steps:
    the first plan's call); and it runs no FA2 varlen call, whose sequences a host-to-device
    copy would bring."""
    for (_, first, second), calls in ranks(2).run(recorded_calls, name):
        assert calls == 4
        assert first == second
        ops = {op for op, _ in first}
        varlen = ("aten._flash_attention_forward", "aten._flash_attention_backward")
        assert not any(op.startswith(varlen) or "_local_scalar_dense" in op for op in ops)


def kept_after_a_call(in_pool: bool) -> int:
    """How many masks a packed plan keeps after one forward call with a GPU's tiles, the
    call run in CUDA graphs' memory pool (``in_pool``: a warm-up of CUDA graph trees) or not."""
    from unittest import mock

    import torch.distributed as dist

    from ringify.runtime.attention import ops
    from ringify.runtime.tiling import tiles

    seq = ROWS * dist.get_world_size()
    program, inputs = document_causal_program(), document_inputs([30, seq - 50, 20])
    geometry = (dist.group.WORLD.group_name, "zigzag", seq)
    with (
        mock.patch.object(ops, "in_graph_pool", lambda device: in_pool),
        mock.patch.object(tiles, "on_accelerator", lambda device_type: True),
    ):
        plan = torch.ops.ringify.attention_plan(program, inputs, ROWS, False, *geometry, 2)
        g = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (torch.randn(2, 4, ROWS, 8, generator=g) for _ in range(3))
        spec = AttentionSpec(geometry[0], 0.35, False, "zigzag", 0.0, program, 2)
        ring_attention_op._init_fn(q, k[:, :2], v[:, :2], None, inputs, seq, spec, plan)
    return sum(len(kept) for kept in plan._kept.values())


def test_a_call_in_cuda_graphs_memory_keeps_no_mask(ranks):
    """CUDA graph trees warm a step up with its allocations in the graphs' private pool, and
    fail a step that leaves a tensor there that is not an output: a ring call run there
    keeps no mask on the plan for the step's later calls (one run elsewhere does)."""
    kept = ranks(2).run(kept_after_a_call, False)
    assert all(n > 0 for n in kept), kept
    assert ranks(2).run(kept_after_a_call, True) == [0, 0]
