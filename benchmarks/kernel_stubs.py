"""The kernels and transfers of a ring call replaced by stubs, for ``host_overhead.py``.

A stub allocates its outputs and does nothing else, so that a call's time is its host work
alone: FA2's ATen kernels (under ringify's FA2 wrappers, which run: a bf16 block's path on a
GPU), the biased blocks' kernels, ``merge_block``, ``additive_mask`` and the P2P exchange;
and PyTorch's ring's rotations and merger.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import torch


def ringify_stubs(sent: list[float]):
    """The attention kernels and the P2P exchange replaced, in every runtime module using them
    (``sent``: the bytes they would send, the FLOPs they would run); and the tiles a GPU
    would use and the masks it would keep for a step (``tiles.on_accelerator``), on these
    CPU tensors."""
    from ringify.runtime.attention import blocks, flash, protocol
    from ringify.runtime.collectives import ring as ring_module
    from ringify.runtime.tiling import tiles

    areas: dict[tuple, float] = {}  # by a call's sequences and window: worked out once

    def work(q, k, is_causal):  # the FLOPs the kernel would run
        b, h, s, d = q.shape
        return 2 * 2 * b * h * s * k.shape[2] * d * (0.5 if is_causal else 1.0)

    def varlen_work(q, varlen):  # q: (rows, heads, D); the keys its window leaves each row
        key = (varlen.cu.numpy().tobytes(), varlen.window)  # no ATen op: not the call's work
        if key not in areas:
            areas[key] = _varlen_area(varlen)
        return 2 * 2 * q.shape[1] * areas[key] * q.shape[2]

    def forward(q, k, v, *, is_causal, scale, bias=None, **_):
        sent[1] += work(q, k, is_causal)
        if bias is not None:  # the efficient kernel with a bias: its outputs
            return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        # bf16 on a GPU: FA2's wrappers run for real (their views and dense copies are host
        # work a GPU pays), only the ATen kernels under them are stubbed (``_FlashKernels``)
        q, k, v = protocol.unit_last_stride(q, k, v)
        return flash.flash_forward(q, k, v, is_causal=is_causal, scale=scale)

    def backward(dout, q, k, v, out, lse, *, is_causal, scale, bias=None, **_):
        sent[1] += 2.5 * work(q, k, is_causal)
        if bias is not None:
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout, q, k, v, out = protocol.unit_last_stride(dout, q, k, v, out)
        return flash.flash_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale)

    def varlen_forward(q, k, v, varlen, *, scale):  # FA2's layout: (rows, heads, D)
        sent[1] += varlen_work(q, varlen)
        return flash.varlen_forward(q, k, v, varlen, scale=scale)

    def varlen_backward(dout, q, k, v, out, lse, varlen, *, scale):
        sent[1] += 2.5 * varlen_work(q, varlen)
        return flash.varlen_backward(dout, q, k, v, out, lse, varlen, scale=scale)

    def exchange(ring, sends, receives, *, tag=0):  # what the real one launches: dense sends
        batches = [[t.contiguous() for t in ts] for _, ts in sends]
        sent[0] += sum(t.numel() * t.element_size() for ts in batches for t in ts)
        return ring_module.PendingStep([], [batch for _, batch in receives], [])

    def bias(mask, dtype):  # a kernel: its output allocated, not written (2 launches on a GPU)
        return torch.empty(mask.shape, dtype=dtype, device=mask.device)

    patches = [
        ("block_forward", forward),
        ("block_backward", backward),
        ("varlen_forward", varlen_forward),
        ("varlen_backward", varlen_backward),
        ("merge_block", lambda *a: None),
        ("additive_mask", bias),
        ("start_exchange", exchange),
    ]
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(tiles, "on_accelerator", lambda _: True))
    stack.enter_context(mock.patch.object(flash, "aten", _FlashKernels))
    # these CPU tensors stand for bf16 ones on a GPU: open pairs run as FA2 varlen calls
    stack.enter_context(mock.patch.object(blocks, "serves_varlen", lambda q: True))
    for name in (
        "attention.ops",
        "attention.protocol",
        "collectives.ring",
        "masks.tile_masks",
        "masks.step_layout",
    ):
        module = __import__(f"ringify.runtime.{name}", fromlist=["_"])
        for attribute, stub in patches:
            if hasattr(module, attribute):
                stack.enter_context(mock.patch.object(module, attribute, stub))
    return stack


class _FlashKernels:
    """FA2's ATen kernels (``flash.aten``), as stubs that allocate their outputs."""

    @staticmethod
    def _scaled_dot_product_flash_attention(q, k, v, *_, **__):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @staticmethod
    def _flash_attention_forward(q, k, v, *_, **__):  # (rows, H, D); lse (H, rows)
        return torch.empty_like(q), q.new_empty(q.shape[1::-1], dtype=torch.float32)

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(dout, q, k, v, *_, **__):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    _flash_attention_backward = _scaled_dot_product_flash_attention_backward


def _varlen_area(varlen) -> float:
    """The (query, key) pairs a varlen call's window leaves (FA2's documented semantics),
    worked out in numpy: no ATen op, so none is counted as the call's."""
    (cu_q, cu_k), (left, right) = varlen.cu.numpy().tolist(), varlen.window
    area = 0.0
    for i in range(len(cu_q) - 1):
        s, t = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        j = np.arange(s)
        first = np.zeros(s) if left < 0 else np.maximum(j + t - s - left, 0)
        stop = np.full(s, t) if right < 0 else np.minimum(j + t - s + right + 1, t)
        area += float(np.maximum(stop - first, 0).sum())
    return area


def torch_ring_stubs():
    """PyTorch's ring (``_templated_ring_attention``) under the same stubs: its K/V and dK/dV
    rotations move nothing, its per-step merge (``_SDPAMerger``, as our stubbed
    ``merge_block``) keeps the first block's result."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    class Rotater:
        def exchange_buffers(self, buffer):
            self.buffer = buffer

        def next_buffer(self):
            return torch.empty_like(self.buffer)

    class Merger:
        def __init__(self, *args, **kwargs):
            self.first = None

        def step(self, out, lse, partial):
            self.first = self.first or (out, lse)

        def results(self):
            return self.first

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(cp, "_create_rotater", lambda *a, **k: Rotater()))
    stack.enter_context(mock.patch.object(cp, "_SDPAMerger", Merger))
    return stack
