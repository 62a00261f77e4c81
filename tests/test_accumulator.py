"""A ring call's accumulators take their first whole block instead of merging it into zeros:
the same result, exactly, with nothing zero-filled or merged for it (``attention/protocol.py``)."""

from __future__ import annotations

import pytest
import torch
from test_gpu_readiness import GEOMETRY, N, _case, layer_bodies, meta_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.protocol import Accumulator, RowSum, merge_block
from ringify.runtime.attention.spec import AttentionSpec

ROWS = 12


def _q() -> torch.Tensor:
    """q as a model's attention gets it: (B, H, S, D), a view of (B, S, H, D)."""
    return torch.randn(1, ROWS, 3, 4, dtype=torch.float64).transpose(1, 2)


def _block(rows: slice, empty_row: int | None = None):
    """A block's (out, lse) over ``rows`` of ``_q``, one row seeing no key (out 0, lse -inf)."""
    n = rows.stop - rows.start
    out, lse = torch.randn(1, 3, n, 4, dtype=torch.float64), torch.randn(1, 3, n).double()
    if empty_row is not None:
        out[:, :, empty_row], lse[:, :, empty_row] = 0.0, float("-inf")
    return out, lse


def _merged_into_zeros(q, blocks):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for rows, (o, s) in blocks:
        merge_block(out[:, :, rows], lse[:, :, rows], o, s)
    return out, lse


@pytest.mark.parametrize(
    "order",
    [
        [slice(0, ROWS), slice(0, 5), slice(5, ROWS)],  # the first whole: taken
        [slice(0, 5), slice(0, ROWS), slice(5, ROWS)],  # the first partial: zeros, merged
        [slice(3, 8)],  # rows no block covers
        [],  # no block at all
    ],
)
def test_the_accumulator_is_the_merge_into_zeros_exactly(order):
    torch.manual_seed(0)
    q = _q()
    blocks = [(rows, _block(rows, empty_row=1)) for rows in order]
    acc = Accumulator(q, torch.float64)
    for rows, (o, s) in blocks:
        acc.merge(rows, o.clone(), s.clone())
    out, lse = acc.results()
    want_out, want_lse = _merged_into_zeros(q, blocks)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert out.transpose(1, 2).is_contiguous()  # in q's dim order, as the fake kernel states
    assert lse.is_contiguous()


def test_a_whole_first_block_is_the_accumulator_itself():
    q = _q()
    out, lse = (
        torch.randn(1, ROWS, 3, 4, dtype=torch.float64).transpose(1, 2),
        torch.randn(1, 3, ROWS),
    )
    acc = Accumulator(q, torch.float64)
    acc.merge(slice(0, ROWS), out, lse.double())
    got_out, _ = acc.results()
    assert got_out is out  # in q's dim order and dtype already: nothing copied


@pytest.mark.parametrize("first_whole", [True, False])
def test_a_row_sum_is_zeros_added_to_dense(first_whole):
    torch.manual_seed(0)
    shape = (1, 3, ROWS, 4)
    parts = [slice(0, ROWS), slice(2, 7)] if first_whole else [slice(2, 7), slice(0, ROWS)]
    # strided float64 grads, as kernels may return them, summed in float32
    grads = [
        torch.randn(1, r.stop - r.start, 3, 4, dtype=torch.float64).transpose(1, 2) for r in parts
    ]
    total = RowSum(torch.Size(shape), torch.float32, torch.device("cpu"))
    want = torch.zeros(shape, dtype=torch.float32)
    for rows, g in zip(parts, grads, strict=True):
        total.add(rows, g)
        want[:, :, rows].add_(g)
    got = total.result()
    assert torch.equal(got, want) and got.is_contiguous() and got.dtype == torch.float32
    assert torch.equal(
        RowSum(torch.Size(shape), torch.float32, torch.device("cpu")).result(), 0 * want
    )


class _Fills(TorchDispatchMode):
    """The ATen ops that fill a floating buffer on the device with a constant (zeros, -inf),
    counted (the plan's host work and a kernel's RNG state are not results)."""

    FILLS = frozenset({"zero_", "fill_", "zeros", "full", "zeros_like", "full_like"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FILLS:
            self.count += out.device.type == "meta" and out.is_floating_point()
        return out


def test_a_causal_call_fills_no_accumulator_on_a_device():
    """On meta (CUDA's branches), a layer under a causal program with no padding keys, whose
    diagonal runs as one call over all the rows, fills no buffer: its out, lse, dQ, dK and dV
    are its blocks' own."""
    program, host, _ = _case("causal")
    q, k, v, dout = meta_tensors()
    spec = AttentionSpec("", 0.125, mask_program=program)
    args = (None, host, N, spec)  # every key real; planned for the device
    with _Fills() as fills:
        out, lse = ring_attention_op._init_fn(q, k, v, *args)
        ring_attention_backward_op._init_fn(dout, q, k, v, out, lse, *args)
    assert fills.count == 0
    with _Fills() as padded:  # padding keys: a partial diagonal, merged into filled buffers
        plan = torch.ops.ringify.attention_plan(program, host, N, False, *GEOMETRY)
        layer_bodies(program, host, plan, q, k, v, dout)
    assert padded.count > 0
