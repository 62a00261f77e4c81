"""Random small models built from the pieces real models are made of, for the generated tests.

A ``ModelSpec`` is a plain frozen value (drawn by hypothesis in ``tests/test_generated_models.py``)
and ``build`` makes the model it names: an entry (token ids, patches of an image, or
features), tokens put in front or behind (a class, a distillation, registers), learned
positions, blocks (a norm, attention written as SDPA or by hand in several spellings, RoPE,
a causal or padding mask, residuals, an MLP, dropout, the sequence split around its
prefix and joined again), a final norm, pooling (first, last, mean, an index, the first
two) and one or two heads. Sizes are drawn so that a feature dim often equals the
sequence's length: nothing in the pass may take a dim for the sequence by its size.
``example`` gives the inputs a spec's model takes, and ``compared`` runs one on a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BlockSpec:
    norm: str = "layer"  # "layer" | "rms"
    spelling: str = "sdpa"  # "sdpa" | "mT" | "einsum" | "bshd" (einsum on (B, S, H, D))
    mask: str = "none"  # "none" | "causal" | "causal_mask" (a bool tril) | "padding"
    rope: bool = False
    mlp: str = "gelu"  # "gelu" | "swiglu"
    hidden: int = 16
    dropout: float = 0.0
    split: bool = False  # the prefix and the rest apart (scaled differently), then joined


@dataclass(frozen=True)
class ModelSpec:
    entry: str  # "tokens" | "patches" | "features"
    length: int  # positions of the entry (tokens, patches, frames)
    width: int
    heads: int
    blocks: tuple[BlockSpec, ...]
    prefix: int = 0  # tokens concatenated in front (class, distillation)
    suffix: int = 0  # tokens concatenated behind (registers)
    positions: bool = True  # learned absolute positions
    pool: str = "none"  # "none" | "first" | "last" | "mean" | "index" | "first_two"
    two_heads: bool = False  # a second head on position 1 (DeiT's distillation token)
    head_dropout: float = 0.0
    batch: int = 2
    features: int = 8  # of a "features" entry; the vocabulary of "tokens"; channels of "patches"

    @property
    def total(self) -> int:
        return self.prefix + self.length + self.suffix

    @property
    def dropout(self) -> bool:
        return self.head_dropout > 0 or any(b.dropout > 0 for b in self.blocks)


class _Rms(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotary(x, positions):
    """RoPE on (B, H, S, D) by halves, from ``positions`` (S,)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    angles = positions.to(x.dtype)[:, None] * freqs[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class _Block(nn.Module):
    def __init__(self, spec: BlockSpec, width: int, heads: int, prefix: int):
        super().__init__()
        self.spec, self.heads, self.prefix = spec, heads, prefix
        norm = nn.LayerNorm if spec.norm == "layer" else _Rms
        self.norm1, self.norm2 = norm(width), norm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        gated = spec.mlp == "swiglu"
        self.up = nn.Linear(width, spec.hidden * (2 if gated else 1))
        self.down = nn.Linear(spec.hidden, width)
        self.drop = nn.Dropout(spec.dropout)
        if spec.split:
            self.scale = nn.Parameter(torch.ones(width) * 0.5)

    def forward(self, x, keep=None):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        if self.spec.rope:
            positions = torch.arange(s)
            q, k = _rotary(q, positions), _rotary(k, positions)
        x = x + self.drop(self.out(self._attend(q, k, v, keep).reshape(b, s, d)))
        up = self.up(self.norm2(x))
        up = (
            F.silu(up.chunk(2, -1)[0]) * up.chunk(2, -1)[1]
            if self.spec.mlp == "swiglu"
            else F.gelu(up)
        )
        x = x + self.drop(self.down(up))
        if self.spec.split and self.prefix:
            head, rest = x[:, : self.prefix], x[:, self.prefix :]
            x = torch.cat([head * self.scale, rest], 1)
        return x

    def _attend(self, q, k, v, keep):
        """(B, S, H, D): attention over (B, H, S, D) q, k and v, in the spec's spelling."""
        s, mask = q.shape[2], None
        if self.spec.mask == "causal_mask":
            mask = torch.ones(s, s, dtype=torch.bool).tril()
        elif self.spec.mask == "padding" and keep is not None:
            mask = keep[:, None, None, :]
        if self.spec.spelling == "sdpa":
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=self.spec.mask == "causal"
            )
            return out.transpose(1, 2)
        if self.spec.mask == "causal":
            mask = torch.ones(s, s, dtype=torch.bool).tril()
        scale = 1 / math.sqrt(q.shape[-1])
        if self.spec.spelling == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
        elif self.spec.spelling == "einsum":
            scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
        else:
            scores = q @ k.mT * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        if self.spec.spelling == "bshd":
            return torch.einsum("bhij,bjhd->bihd", probs, v)
        return (probs @ v).transpose(1, 2)


class Generated(nn.Module):
    """The model a ``ModelSpec`` names."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        d = spec.width
        if spec.entry == "tokens":
            self.embed = nn.Embedding(spec.features, d)
        elif spec.entry == "patches":
            self.embed = nn.Conv2d(spec.features, d, 2, 2)
        else:
            self.embed = nn.Linear(spec.features, d)
        self.front = nn.Parameter(torch.randn(1, spec.prefix, d)) if spec.prefix else None
        self.back = nn.Parameter(torch.randn(1, spec.suffix, d)) if spec.suffix else None
        self.positions = (
            nn.Parameter(torch.randn(1, spec.total, d) * 0.1) if spec.positions else None
        )
        self.blocks = nn.ModuleList(_Block(b, d, spec.heads, spec.prefix) for b in spec.blocks)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(spec.head_dropout)
        self.head = nn.Linear(d, 5)
        self.second = nn.Linear(d, 5) if spec.two_heads else None

    def forward(self, x, keep=None):
        spec = self.spec
        x = self.embed(x)
        if spec.entry == "patches":
            x = x.flatten(2).transpose(1, 2)
        b = x.shape[0]
        front = [self.front.expand(b, -1, -1)] if self.front is not None else []
        back = [self.back.expand(b, -1, -1)] if self.back is not None else []
        x = torch.cat([*front, x, *back], 1) if front or back else x
        if self.positions is not None:
            x = x + self.positions
        for block in self.blocks:
            x = block(x, keep)
        x = self.norm(x)
        pooled = {
            "none": lambda: x,
            "first": lambda: x[:, 0],
            "last": lambda: x[:, -1],
            "mean": lambda: x.mean(1),
            "index": lambda: x[:, x.shape[1] // 2],
            "first_two": lambda: x[:, :2].flatten(1)[:, : x.shape[2]],
        }[spec.pool]()
        out = self.head(self.drop(pooled))
        if self.second is None:
            return out
        return out, self.second(self.drop(x[:, 1]))


def example(spec: ModelSpec, seed: int = 0) -> tuple:
    """The inputs ``spec``'s model takes: the entry's, and a padding mask where a block has one
    (its first position always kept)."""
    g = torch.Generator().manual_seed(seed)
    b = spec.batch
    if spec.entry == "tokens":
        x = torch.randint(0, spec.features, (b, spec.length), generator=g)
    elif spec.entry == "patches":
        side = math.isqrt(spec.length) * 2
        x = torch.randn(b, spec.features, side, side, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(b, spec.length, spec.features, generator=g, dtype=torch.float64)
    if not any(block.mask == "padding" for block in spec.blocks):
        return (x,)
    keep = torch.rand(b, spec.total, generator=g) > 0.3
    keep[:, 0] = True
    return x, keep


def build(spec: ModelSpec, seed: int = 0) -> Generated:
    torch.manual_seed(seed)
    return Generated(spec).double()


def compared(spec: ModelSpec, backend: str | None = None) -> dict:
    """On a rank of the current group: ``spec``'s model ringified against the unmodified
    model in float64, forward and backward: ``out`` and ``grads``, the largest differences
    (with dropout, whose masks are the model's in distribution only: ``agree``, the largest
    difference between ranks, and whether the shapes match); the gathers and regions."""
    import torch.distributed as dist

    from ringify.testing.runs import ringified_run

    model = build(spec)
    inputs = example(spec)
    weights: list[torch.Tensor] = []

    def step(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(2)
        weights[:] = weights or [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [o.detach() for o in outs], grads

    want = step(model)
    ringified, run = ringified_run(model, backend)
    got = step(run)
    report = ringified.report()
    shapes = [o.shape for o in got[0]] == [o.shape for o in want[0]]
    found = {
        "shapes": shapes and got[1].keys() == want[1].keys(),
        "gathers": [g.node for g in report.gathers],
        "resharded": len(report.resharded),
    }
    if not found["shapes"]:
        return found
    if spec.dropout:  # every rank holds the same gathered outputs and reduced gradients
        mine = torch.cat([t.flatten() for t in (*got[0], *got[1].values())])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return found | {"agree": max((e - mine).abs().max().item() for e in every)}
    return found | {
        "out": max((g - w).abs().max().item() for g, w in zip(got[0], want[0], strict=True)),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
    }
