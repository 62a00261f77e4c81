"""A torchtitan-style Llama decoder and torchtitan's tensor-parallel plan for it, for tests
and benchmarks of TP beside the ring.

The model is written as torchtitan writes it: ``tok_embeddings``, blocks of ``attention``
(``wq``, ``wk``, ``wv``, ``wo``; grouped-query; RoPE; causal SDPA) and ``feed_forward``
(SwiGLU ``w1``, ``w2``, ``w3``), RMSNorms, an ``output`` head, and views with ``-1`` heads so
that a TP rank runs its own share. ``parallelize`` is torchtitan's ``apply_tp`` without
sequence parallel: the embedding's vocabulary and every projection split over ``tp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.repeats = dim // heads, heads // kv_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotated(q, *rope), _rotated(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(self.repeats, dim=1) for t in (k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x, rope, mask=None):
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """``forward(tokens, labels=None, positions=None)``: the logits, or the mean cross entropy
    of ``labels`` (-100 ignored). ``positions`` (batch, length) restart per packed document:
    attention then stays inside each document."""

    def __init__(self, vocab=96, dim=64, layers=2, heads=8, kv_heads=4):
        super().__init__()
        self.head_dim = dim // heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, labels=None, positions=None):
        x = self.tok_embeddings(tokens)
        n = tokens.shape[1]
        mask = None
        if positions is None:
            positions = torch.arange(n, device=tokens.device).expand_as(tokens)
        else:
            doc = (positions == 0).cumsum(-1)
            causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
            mask = (doc[:, None, :, None] == doc[:, None, None, :]) & causal
        rope = _rope(positions, self.head_dim, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, mask)
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _rope(positions: torch.Tensor, dim: int, dtype: torch.dtype):
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=positions.device, dtype=dtype) / dim)
    freqs = positions[..., None].to(dtype) * inv
    return freqs.cos()[:, :, None], freqs.sin()[:, :, None]


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return torch.stack([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1).flatten(-2)


def parallelize(model: Transformer, tp_mesh) -> Transformer:
    """torchtitan's ``apply_tp`` plan, without sequence parallel or loss parallel."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    return model
