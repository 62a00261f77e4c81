"""Attention and sequence ops as models write them, each exact on the ring with nothing gathered:
a causal mask from constants (``einsum`` scores, ``nn.MultiheadAttention`` given it, with and
without its weights), nanoGPT's mask cropped from a registered ``tril`` buffer (a program, never
an S x S tensor per rank), a causal mask extended with ``F.pad`` (a program too), ALiBi's bias as
x-transformers makes it, or cuts it from the buffer it keeps (a program: a table of its
diagonals, looked up per pair), a
torchtitan-style layer (RoPE through ``stack``, under
``torch.autocast(enabled=False)``; GQA through ``enable_gqa``, ``repeat_interleave`` or
FlexAttention), a pooled token per row (CLIP's EOS: a few positions taken from their ranks) and
a router's per-position ops that torch leaves without the pointwise tag (``RoutedOutput``).
Float64, against the unmodified model: output and every gradient, on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringify.passes.graph.report import MaskKind
from ringify.testing.runs import ringified_run

TOL = 1e-10
CASES = (
    "einsum", "mha", "mha weights", "nanogpt", "pad", "pad additive", "alibi", "alibi cached",
    "titan", "titan repeat", "titan flex", "pooled", "routed", "counted",
)  # fmt: skip


class AlibiBias(nn.Module):
    """ALiBi's bias as x-transformers' ``AlibiPositionalBias`` makes it: ``-|j - i| * slope`` per
    head from two ``arange``s, padded over the heads it leaves out (none here); with ``keep``,
    registered as a buffer at the first call and cut from it at later ones (``max_len``: one
    made at construction for that many positions)."""

    def __init__(self, heads: int, max_len: int = 0):
        super().__init__()
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("slopes", slopes.view(heads, 1, 1), persistent=False)
        made = self._made(max_len, max_len) if max_len else None
        self.register_buffer("bias", made, persistent=False)

    def _made(self, i: int, j: int) -> torch.Tensor:
        keys, queries = (torch.arange(a, j, device=self.slopes.device) for a in (0, j - i))
        bias = -torch.subtract(keys.view(1, 1, j), queries.view(1, i, 1)).abs() * self.slopes
        return F.pad(bias, (0, 0, 0, 0, 0, 0))

    def forward(self, i: int, j: int, keep: bool = True) -> torch.Tensor:
        if self.bias is not None and self.bias.shape[-1] >= j and self.bias.shape[-2] >= i:
            return self.bias[..., -i:, -j:]
        if not keep:
            return self._made(i, j)
        self.register_buffer("bias", self._made(i, j), persistent=False)
        return self.bias


class ConstantMaskAttention(nn.Module):
    """Attention under a causal mask built from constants, as research code writes it:
    ``einsum`` scores, ``ones((i, j)).triu(j - i + 1)`` filled (``how="einsum"``), an
    ``nn.MultiheadAttention`` given the mask (``how="mha"``, its weights asked for with
    ``need_weights``), SDPA under a causal mask extended with ``F.pad`` by 3 keys every
    query sees (``how="pad"``: a boolean mask padded on the left; ``"pad additive"``: a
    float mask padded on the left and the top), or under ALiBi's bias as x-transformers
    writes it (``"alibi"``: ``-|j - i| * slope`` from ``arange``, padded over the heads it
    leaves out, the causal triangle filled; ``"alibi kept"``: made and kept as a buffer at
    the first call, as x-transformers does; ``"alibi cached"``: made once for 96 positions
    and kept as a buffer, then cut to the call's, as after x-transformers' first call)."""

    def __init__(self, dim=32, heads=4, how="einsum", need_weights=False):
        super().__init__()
        self.heads, self.how, self.need_weights = heads, how, need_weights
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        if how.startswith("alibi"):
            self.alibi = AlibiBias(heads, max_len=96 if how == "alibi cached" else 0)

    def forward(self, x):
        b, n, c = x.shape
        if self.how == "mha":
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            return self.mha(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, -1))
        if self.how.startswith("alibi"):
            bias = self.alibi(n, n, keep=self.how != "alibi")
            hidden = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            mask = bias.masked_fill(hidden, -torch.finfo(bias.dtype).max)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(y.transpose(1, 2).reshape(b, n, c))
        if self.how.startswith("pad"):
            sinks = 3
            if self.how == "pad":
                mask = torch.ones(n, n - sinks, dtype=torch.bool, device=x.device).tril(-sinks)
                mask = F.pad(mask, (sinks, 0), value=True)
            else:
                hidden = torch.ones(n - sinks, n - sinks, dtype=torch.bool, device=x.device)
                mask = torch.zeros(hidden.shape, dtype=x.dtype, device=x.device)
                mask = mask.masked_fill(hidden.triu(1), float("-inf"))
                mask = F.pad(mask, (sinks, 0, sinks, 0), value=0.0)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(y.transpose(1, 2).reshape(b, n, c))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (c // self.heads) ** -0.5
        i, j = sim.shape[-2:]
        hidden = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
        attn = sim.masked_fill(hidden, -torch.finfo(sim.dtype).max).softmax(-1)
        return self.out(torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(b, n, c))


class RotaryDecoder(nn.Module):
    """A torchtitan-style attention layer: RoPE of interleaved pairs, ``torch.stack([...],
    -1).flatten(-2)``, under ``torch.autocast(enabled=False)`` (as HF's rotary embeddings),
    grouped-query attention through SDPA's ``enable_gqa`` (``gqa="sdpa"``), K/V repeated with
    ``repeat_interleave`` (``"repeat_interleave"``) or FlexAttention (``"flex"``); then the
    hidden state at each row's highest id (CLIP's pooled EOS token) with ``pooled``."""

    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=2, gqa="sdpa", pooled=False):
        super().__init__()
        self.heads, self.kv_heads, self.gqa, self.pooled = heads, kv_heads, gqa, pooled
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim * kv_heads // heads, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def _rotated(self, t):
        d = t.shape[-1]
        with torch.autocast(device_type=t.device.type, enabled=False):
            pos = torch.arange(t.shape[1], device=t.device, dtype=t.dtype)
            freqs = pos[:, None] / 10000 ** (
                torch.arange(0, d, 2, device=t.device, dtype=t.dtype) / d
            )
            cos, sin = freqs.cos()[None, :, None], freqs.sin()[None, :, None]
            t1, t2 = t[..., 0::2], t[..., 1::2]
            return torch.stack([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1).flatten(-2)

    def forward(self, ids):
        x = self.embed(ids)
        b, n, c = x.shape
        q = self._rotated(self.q(x).view(b, n, self.heads, -1)).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, -1).unbind(2)
        k, v = self._rotated(k).transpose(1, 2), v.transpose(1, 2)
        if self.gqa == "repeat_interleave":
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.gqa == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            mask = create_block_mask(lambda b_, h, i, j: i >= j, b, None, n, n, device=x.device)
            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = self.out(y.transpose(1, 2).reshape(b, n, c))
        return y[torch.arange(b, device=ids.device), ids.argmax(-1)] if self.pooled else y


class RoutedOutput(nn.Module):
    """Causal attention, then per-position ops whose overloads torch leaves without the
    pointwise tag: a router's ``logsigmoid`` and ``logsumexp`` over its experts (as HF
    Inkling's), ``hardswish``, ``where`` with a scalar, ``masked_fill`` with a 0-dim tensor,
    and ``rsub``."""

    def __init__(self, dim: int = 32, heads: int = 4, experts: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.router = nn.Linear(dim, 3 * dim), nn.Linear(dim, experts)
        self.out = nn.Linear(dim, dim)
        self.fill = nn.Buffer(torch.tensor(0.5))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        y = y.reshape(b, n, c)
        log_p = F.logsigmoid(self.router(y))
        weights = torch.exp(log_p - torch.logsumexp(log_p, -1, keepdim=True))
        h = F.hardswish(self.out(y)) * weights.amax(-1, keepdim=True)
        h = torch.where(h > 0, h, 0.1).masked_fill(h < -0.5, self.fill.to(h.dtype))
        return torch.rsub(h, x)


class CountedRoutes(nn.Module):
    """A router's load over every token, counted by ``bincount`` and by ``histc`` (as MoE
    layers count their experts' loads), on a length the ring pads: padding never counted."""

    def __init__(self, dim: int = 32, experts: int = 4):
        super().__init__()
        self.router, self.out, self.experts = nn.Linear(dim, experts), nn.Linear(dim, dim), experts
        self.padded = True

    def forward(self, x):
        ids = self.router(x).argmax(-1).flatten()
        counted = torch.bincount(ids, minlength=self.experts)
        binned = torch.histc(ids.double(), bins=self.experts, min=0, max=self.experts - 1)
        load = (counted + binned).to(x.dtype) / ids.numel()
        return self.out(x) * load[ids].view(x.shape[:2]).unsqueeze(-1)


def _model(case: str):
    from ringify.testing import models

    torch.manual_seed(0)
    return {
        "einsum": lambda: ConstantMaskAttention(how="einsum"),
        "mha": lambda: ConstantMaskAttention(how="mha"),
        "mha weights": lambda: ConstantMaskAttention(how="mha", need_weights=True),
        "nanogpt": lambda: models.Block(32, 4, models.AttentionByHand(max_len=128)),
        "pad": lambda: ConstantMaskAttention(how="pad"),
        "pad additive": lambda: ConstantMaskAttention(how="pad additive"),
        "alibi": lambda: ConstantMaskAttention(how="alibi"),
        "alibi cached": lambda: ConstantMaskAttention(how="alibi cached"),
        "titan": RotaryDecoder,
        "titan repeat": lambda: RotaryDecoder(gqa="repeat_interleave"),
        "titan flex": lambda: RotaryDecoder(gqa="flex"),
        "pooled": lambda: RotaryDecoder(pooled=True),
        "routed": RoutedOutput,
        "counted": CountedRoutes,
    }[case]().double()


def compare(case: str):
    import torch.distributed as dist

    from ringify.testing.runs import quadratic_nodes

    model = _model(case)
    seq = 20 * dist.get_world_size()  # no dim of the models is this long
    seq -= 3 if getattr(model, "padded", False) else 0
    g = torch.Generator().manual_seed(1)
    ids = case.startswith(("titan", "pooled"))
    x = (
        torch.randint(0, 64, (2, seq), generator=g)
        if ids
        else torch.randn(2, seq, 32, generator=g, dtype=torch.float64)
    )
    grads = case != "titan flex"  # FlexAttention has no backward on the CPU
    model.requires_grad_(grads)
    with torch.set_grad_enabled(grads):
        want = model(x)
        if grads:
            want.square().sum().backward()
        wanted = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        ringified, run = ringified_run(model)
        got = run(x)
        if grads:
            got.square().sum().backward()
    report = ringified.report()
    return {
        "out": (got - want).abs().max().item(),
        "grads": max(
            [
                (p.grad - wanted[n]).abs().max().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            ]
            or [0.0]
        ),
        "same grads": {n for n, p in model.named_parameters() if p.grad is not None} == set(wanted),
        "gathers": [(x.op, x.reason.value) for x in report.gathers],
        "masks": [a.mask for a in report.attentions],
        "quadratic": quadratic_nodes(ringified, seq),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_the_form_is_exact_and_nothing_is_gathered(ranks, world, case):
    for r in ranks(world).run(compare, case):
        assert r["out"] <= TOL and r["grads"] <= TOL and r["same grads"], r
        assert r["gathers"] == [], r["gathers"]
        assert r["quadratic"] == [], r["quadratic"]
        if not case.startswith(("titan", "pooled", "routed", "counted")):
            assert r["masks"] == [MaskKind.PROGRAM], r["masks"]


def traced_first():
    """``"alibi kept"`` ringified before its first call: the trace registers no buffer in the
    model (it would be a fake tensor of the trace); the model, called after, makes and keeps
    its own, and computes what the ringified model did."""
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    model = ConstantMaskAttention(how="alibi kept").double()
    x = torch.randn(2, 20 * dist.get_world_size(), 32, dtype=torch.float64)
    ringified = ringify(model, ring_size=dist.get_world_size())
    got = ringified(x)
    kept_by_the_trace = model.alibi.bias is not None
    want = model(x)
    return kept_by_the_trace, (got - want).abs().max().item(), ringified.report().attentions[0].mask


def test_a_buffer_the_forward_registers_is_not_left_by_the_trace(ranks):
    for kept, out, mask in ranks(2).run(traced_first):
        assert not kept and out <= TOL and mask is MaskKind.PROGRAM, (kept, out, mask)
