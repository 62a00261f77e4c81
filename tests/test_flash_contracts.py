"""FlashAttention-2's contracts, held on CPU: FA2 runs only on CUDA, so its branch runs here on
the meta device (the block ops' bodies take their CUDA path for any non-CPU tensor) under a
dispatch mode that logs every flash call, and the squaring of causal blocks is checked
numerically against a CPU kernel with FA2's bottom-right alignment."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ringify.runtime.attention.blocks import (
    block_backward,
    block_forward,
    math_backward,
    math_forward,
)
from ringify.runtime.attention.flash import top_left, top_left_backward

aten = torch.ops.aten
FLASH = {
    aten._scaled_dot_product_flash_attention.default: "forward",
    aten._scaled_dot_product_flash_attention_backward.default: "backward",
}
EFFICIENT = (
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
)


class FlashCalls(TorchDispatchMode):
    """Every flash call: (direction, query rows, key rows, is_causal, lse dense or None), and
    the (query heads, key heads) of each in ``heads``; every bias the memory-efficient kernel
    gets, in ``biases``: (its strides, its dtype is q's)."""

    def __init__(self):
        super().__init__()
        self.calls, self.heads, self.biases = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in EFFICIENT:
            given = _by_name(func, args, kwargs or {})
            bias = given.get("attn_bias")
            if bias is not None:
                self.biases.append((bias.stride(), bias.dtype == given["query"].dtype))
        if func in FLASH:
            given = _by_name(func, args, kwargs or {})
            lse = given.get("logsumexp")
            rows, keys = given["query"].shape[2], given["key"].shape[2]
            dense = None if lse is None else lse.is_contiguous()
            self.calls.append((FLASH[func], rows, keys, given["is_causal"], dense))
            self.heads.append((given["query"].shape[1], given["key"].shape[1]))
        return func(*args, **(kwargs or {}))


VARLEN = {
    aten._flash_attention_forward.default: "forward",
    aten._flash_attention_backward.default: "backward",
}


class VarlenCalls(TorchDispatchMode):
    """Every FA2 varlen call (``masks/calls.py``): (direction, its arguments by name)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in VARLEN:
            self.calls.append((VARLEN[func], _by_name(func, args, kwargs or {})))
        return func(*args, **(kwargs or {}))

    def check_contracts(self, heads: tuple[int, int]) -> None:
        """What FA2 reads unchecked: sequences on q's device as dense int32, (rows, heads, D) views
        with a contiguous last dim, GQA's K/V heads as they are (``heads``: query, key), a
        window of ints each -1 or narrower than the longest keys (FA2 reads a wider side as
        -1, no bound), and (backward) a dense lse."""
        for direction, call in self.calls:
            for cu in (call["cum_seq_q"], call["cum_seq_k"]):
                assert cu.device == call["query"].device and cu.dtype == torch.int32
                assert cu.is_contiguous()
            assert all(call[x].stride(-1) == 1 for x in ("query", "key", "value"))
            assert (call["query"].shape[1], call["key"].shape[1]) == heads
            for side in ("window_size_left", "window_size_right"):
                assert isinstance(call[side], int) and call[side] >= -1
                assert call[side] == -1 or call[side] < call["max_k"]
            assert direction == "forward" or call["logsumexp"].is_contiguous()


def _by_name(func, args, kwargs) -> dict:
    """A call's arguments by their schema names, defaults filled in."""
    schema = func._schema.arguments
    return {
        a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        for i, a in enumerate(schema)
    }


def _bottom_right_bias(s: int, t: int) -> torch.Tensor:
    """FA2's causal mask for s queries and t keys: query i sees keys j <= i + t - s."""
    i, j = torch.arange(s).view(-1, 1), torch.arange(t).view(1, -1)
    return torch.zeros(s, t, dtype=torch.float64).masked_fill(j > i + t - s, float("-inf"))


def _fa2_forward(q, k, v, is_causal, scale):
    """A CPU stand-in with FA2's alignment (a fully masked row: out 0, lse -inf)."""
    bias = _bottom_right_bias(q.shape[2], k.shape[2]) if is_causal else None
    out, lse = math_forward(q, k, v, is_causal=False, scale=scale, bias=bias)
    return out.nan_to_num(0.0), lse


def _fa2_backward(dout, q, k, v, out, lse, is_causal, scale):
    assert lse.is_contiguous()  # FA2 reads it through its data pointer
    bias = _bottom_right_bias(q.shape[2], k.shape[2]) if is_causal else None
    return math_backward(dout, q, k, v, out, lse, is_causal=False, scale=scale, bias=bias)


@pytest.mark.parametrize(("s", "t"), [(6, 6), (6, 4), (4, 6)])
def test_causal_blocks_are_top_left_on_a_bottom_right_kernel(s, t):
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 3, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 3, t, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3)
    want.backward(dout)
    out, lse = top_left(_fa2_forward, q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    grads = top_left_backward(_fa2_backward, dout, q, k, v, out, lse, is_causal=True, scale=0.3)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)
    if s != t:  # the hazard is real: the kernel alone answers another question
        raw, _ = _fa2_forward(q, k, v, True, 0.3)
        assert (raw - want).abs().max() > 1e-3


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(("s", "t"), [(8, 8), (8, 6), (6, 8)])
def test_flash_gets_square_causal_blocks_and_a_dense_lse(s, t):
    """The CUDA branch of the block kernels, on meta tensors in bf16: the ring hands a block
    a strided slice of the merged lse, a padded diagonal tile is non-square, and K/V have
    their GQA heads."""
    q, dout, out = _meta(2, 4, s, 16), _meta(2, 4, s, 16), _meta(2, 4, s, 16)
    k, v = _meta(2, 2, t, 16), _meta(2, 2, t, 16)  # GQA: 2 kv heads
    merged_lse = _meta(2, 4, 2 * s, dtype=torch.float32)
    lse = merged_lse[:, :, 1::2]  # a tile's rows of the merged lse
    with FlashCalls() as log:
        got_out, got_lse = block_forward(q, k, v, is_causal=True, scale=0.25)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, is_causal=True, scale=0.25)
    assert got_out.shape == q.shape and got_lse.shape == q.shape[:3]
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {d for d, *_ in log.calls} == {"forward", "backward"}
    for direction, rows, keys, causal, dense in log.calls:
        assert not causal or rows == keys, log.calls  # FA2 would align it bottom-right
        assert direction == "forward" or dense, log.calls
    assert set(log.heads) == {(4, 2)}  # K/V reach FA2 unexpanded (it takes GQA natively)
