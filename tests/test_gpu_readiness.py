"""The ring loop on a device, held on CPU: the op's forward and backward bodies run on meta
tensors (which take the CUDA branches of every kernel call), their plan made by ``attention_plan`` from
host copies of the mask program's inputs. A meta tensor cannot be read, and an op mixing it with
a CPU tensor raises: so the loop reads nothing from the device and mixes no host tensor in,
for a causal, a packed-document, a sliding-window and a learned program; and every FlashAttention
call keeps its contracts (square when causal, a dense lse)."""

from __future__ import annotations

import pytest
import torch
from test_flash_contracts import FlashCalls

from ringify.runtime.attention_plan import plan_lookups, reset_plan_lookups
from ringify.runtime.mask_program import MaskProgram
from ringify.runtime.ring_ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.tiles import MIN_TILE_ROWS
from ringify.testing.attention import document_causal_program, document_inputs

N = 3 * MIN_TILE_ROWS  # one tile of three 1024-row blocks: open pairs cut into blocks
CAUSAL = (("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),)
WINDOW = (
    *CAUSAL,
    ("sub.Tensor", ({"pos": "q"}, {"pos": "k"}), "int64"),
    ("lt.Scalar", ({"op": 1}, MIN_TILE_ROWS + 100), "bool"),
    ("__and__.Tensor", ({"op": 0}, {"op": 2}), "bool"),
)
KEYS = N - 7  # the last keys are padding


def _case(name: str):
    """(program text, its inputs on the host, whether they are learned)."""
    lengths = [700, 1500, N - 2200]
    if name == "causal":
        return MaskProgram((), CAUSAL).text(), [], False
    if name == "window":
        return MaskProgram((), WINDOW).text(), [], False
    if name == "packed":
        return document_causal_program(), document_inputs(lengths), False
    bias = torch.randn(1, N, dtype=torch.float32)  # "learned": a per-key float input
    return document_causal_program(learned=True), [*document_inputs(lengths), bias], True


@pytest.mark.parametrize("name", ["causal", "packed", "window", "learned"])
def test_the_ring_loop_reads_nothing_and_mixes_nothing_on_a_device(name):
    program, host, learned = _case(name)
    scale = 0.125
    geometry = ("", "contiguous", KEYS)
    handle = torch.ops.ringify.attention_plan(program, host, N, False, *geometry)
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    q, dout = meta(1, 4, N, 64), meta(1, 4, N, 64)
    k, v = meta(1, 2, N, 64), meta(1, 2, N, 64)  # GQA: 2 kv heads
    inputs = [x.to("meta") for x in host]
    reset_plan_lookups()
    args = (None, False, scale, *geometry, program, inputs, 0, True, handle)
    # The ops' bodies themselves: a meta tensor given to the op would dispatch to its fake kernel.
    with FlashCalls() as log:
        out, lse = ring_attention_op._init_fn(q, k, v, *args)
        wanted = [x.is_floating_point() for x in inputs]
        dq, dk, dv, _, dinputs = ring_attention_backward_op._init_fn(
            dout, q, k, v, out, lse, None, False, scale, *geometry, program, inputs, 0,
            mask_grad=False, input_grads=wanted, balance=True, plan=handle,
        )  # fmt: skip
    assert plan_lookups() == {"by handle": 2, "host copies": 0, "built": 0}
    assert (out.shape, lse.shape) == (q.shape, q.shape[:3])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert [d.shape for d, w in zip(dinputs, wanted, strict=True) if w] == [
        x.shape for x in inputs if x.is_floating_point()
    ]
    for direction, rows, keys, causal, dense in log.calls:
        assert not causal or rows == keys, log.calls
        assert direction == "forward" or dense, log.calls
    assert set(log.heads) <= {(4, 2)}  # GQA's K/V reach FA2 unexpanded
    if not learned:  # causal blocks on the diagonal reach FA2 (a learned one has a bias)
        assert any(causal for *_, causal, _ in log.calls), log.calls
