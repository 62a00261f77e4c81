"""An accelerator's plan, exact on the CPU. On a GPU the op cuts a chunk into as few tiles as
keep each under 16384 rows, makes a step's masks on the device once for every layer
(``ringify::step_masks``), runs a mostly visible open pair as one masked call and joins a
step's whole pairs; on the CPU none of it runs (``tiles.on_accelerator``). Here it is
switched on for CPU tensors, and two layers sharing one plan and its step masks are compared
with SDPA on the full sequence in float64, forward and backward: neither evaluates a mask."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime import shard
from ringify.runtime.attention.spec import AttentionSpec
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs
from ringify.testing.tolerance import EXACT, relative_difference

SEQ = 8192  # ring of 2, zigzag: chunks of 2048 rows, one tile each, cut into 1024-row blocks


def _case(name: str):
    """(program text, its inputs, the full (S, S) bool mask it stands for)."""
    from ringify.runtime.masks.program import MaskProgram

    pos = torch.arange(SEQ)
    causal = pos[None, :] <= pos[:, None]
    if name == "packed":
        lengths = [1500, 2600, SEQ - 4100]
        docs = document_inputs(lengths)
        return document_causal_program(), docs, causal & (docs[0] == docs[1])
    if name == "packed, padded":  # a document starts in the last tile, its keys mostly padding
        docs = document_inputs([1500, 2600, 2100, SEQ - 6200])
        docs[1] = docs[1].masked_fill(pos >= 6300, -1)  # keys 6300 on: no document's
        return document_causal_program(), docs, causal & (docs[0] == docs[1])
    if name == "padded":  # HF's right padding: causal, and the last keys are no key at all
        valid = (pos < SEQ - 1900).view(1, -1)  # a block of padding and part of another
        program = MaskProgram(
            roles=("k",),
            code=(
                ("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),
                ("__and__.Tensor", ({"op": 0}, {"in": 0}), "bool"),
            ),
        )
        return program.text(), [valid], causal & valid
    window = 1100  # edges inside blocks
    program = MaskProgram(
        roles=(),
        code=(
            ("sub.Tensor", ({"pos": "q"}, {"pos": "k"}), "int64"),
            ("ge.Scalar", ({"op": 0}, 0), "bool"),
            ("lt.Scalar", ({"op": 0}, window), "bool"),
            ("__and__.Tensor", ({"op": 1}, {"op": 2}), "bool"),
        ),
    )
    return program.text(), [], causal & (pos[:, None] - pos[None, :] < window)


def two_layers_on_an_accelerator_plan(name: str, budget: int = 4):
    """On every rank: the largest relative difference from SDPA of two layers' outputs and
    q/k/v gradients, how many masks the step's masks hold, the forward's kernel calls per
    layer, and how many masks the layers evaluated themselves."""
    import torch.distributed as dist

    from ringify.runtime.attention import ops
    from ringify.runtime.masks import step_layout, tile_masks
    from ringify.runtime.tiling import tiles

    program, inputs, mask = _case(name)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 2, SEQ, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    want.backward(full[3])
    expected = [want.detach(), *(x.grad for x in leaves)]
    group, rows = dist.group.WORLD.group_name, SEQ // 2
    worst, calls, evaluated = 0.0, [], []
    block, evaluate = ops.block_forward, tile_masks.evaluate

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])
        return block(*args, **kwargs)

    with (
        mock.patch.object(tiles, "on_accelerator", lambda _: True),
        mock.patch.object(ops, "block_forward", counted),
        # a call's masks evaluated on the device
        mock.patch.object(tile_masks, "evaluate", lambda *a: evaluated.append(1) or evaluate(*a)),
        # float64 biases: four times a bf16 step's bytes, within ``budget`` times its budget
        mock.patch.object(
            step_layout, "KEPT_BYTES_PER_ROW", budget * step_layout.KEPT_BYTES_PER_ROW
        ),
    ):
        plan = torch.ops.ringify.attention_plan(program, inputs, rows, False, group, "zigzag", SEQ)
        cpu = torch.device("cpu")
        made = torch.ops.ringify.step_masks(inputs, plan, torch.float64, False, cpu, rows)
        step_masks = list(made)
        for _ in range(2):  # two layers of one step, on its masks
            q, k, v = (shard(t, 2, layout="zigzag").requires_grad_() for t in full[:3])
            spec = AttentionSpec(group, 0.5, layout="zigzag", mask_program=program)
            args = (None, inputs, SEQ, spec, plan, None, step_masks)
            out, _ = torch.ops.ringify.ring_attention(q, k, v, *args)
            out.backward(shard(full[3], 2, layout="zigzag"))
            for got, ref in zip((out, q.grad, k.grad, v.grad), expected, strict=True):
                ref = shard(ref, 2, layout="zigzag")
                worst = max(worst, relative_difference(got.detach(), ref))
        capacity = step_layout.Capacity(made[0].shape[0], made[1].shape[1])
        kept = len(plan.step_layout(torch.float64, False, capacity).biases)
    return worst, kept, len(calls) / 2, len(evaluated)


@pytest.mark.parametrize("name", ["packed", "window", "padded", "packed, padded"])
def test_an_accelerators_plan_is_exact(ranks, name):
    for worst, kept, calls, evaluated in ranks(2).run(two_layers_on_an_accelerator_plan, name):
        assert worst <= EXACT, worst
        assert evaluated == 0  # every mask came from the step's masks
        if name == "padded":  # no mask: one call per step, as is_causal makes
            assert calls == 2, calls  # the padding keys cut off the shard's causal call
        else:
            assert kept > 0  # the step's masks hold them, read by both layers


def test_masks_beyond_the_budget_are_made_in_the_call(ranks):
    """The step's masks hold at most ``KEPT_BYTES_PER_ROW`` per query row: the blocks beyond
    (float64 at a bf16 budget) are evaluated in each call, exactly."""
    for worst, kept, _, evaluated in ranks(2).run(two_layers_on_an_accelerator_plan, "packed", 1):
        assert worst <= EXACT, worst
        assert kept > 0 and evaluated > 0, (kept, evaluated)
