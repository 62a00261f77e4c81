"""Small models for tests and benchmarks, written as users write them (nothing ringify-specific)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend=F.scaled_dot_product_attention):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class AttentionByHand(nn.Module):
    """nanoGPT's attention without flash: ``softmax(q k^T / sqrt(d))`` under a causal
    buffer of ones, then times v (``attend`` for ``Block``)."""

    def __init__(self, max_len=128):
        super().__init__()
        self.register_buffer(
            "bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len)
        )
        self.drop = nn.Dropout(0.0)

    def forward(self, q, k, v, is_causal=True):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.drop(att) @ v


class NanoGPT(nn.Module):
    """nanoGPT's shape: learned positions, tied embeddings, the loss inside forward.

    ``attend`` is the attention function (SDPA; a test swaps in ``dilated_attention``).
    """

    def __init__(
        self,
        vocab=64,
        max_len=128,
        dim=32,
        heads=4,
        layers=2,
        attend=F.scaled_dot_product_attention,
    ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class RunningModel(nn.Module):
    """Attention followed by an op over the sequence: ``"cumsum"`` (a scan over the ring),
    ``"pool"`` (max and min pooling: maxima over the ring), ``"argmax"``, ``"softmax"``
    (normalised over the ring), ``"take"`` (a cls token, the last token and picked positions:
    taken from the ranks that hold them) or ``"cummax"`` (no rule: gathered)."""

    def __init__(self, running: str = "cumsum", dim=16, heads=2):
        super().__init__()
        self.heads, self.running = heads, running
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        if self.running == "cummax":
            return self.out(y.cummax(dim=1).values)
        if self.running == "pool":
            centred = (y - y.amax(1, keepdim=True)).exp().sum(1)  # the max meets the sequence
            centred = centred + (y - y.mean(1, keepdim=True)).square().sum(1)  # and the mean
            return self.out(y.amax(1) - y.amin(1, keepdim=True).squeeze(1)) + y.max() + centred
        if self.running == "argmax":  # the position of each row's largest activation
            where = y.sum(-1).argmax(1, keepdim=True) + y.mean(-1).argmax(1).unsqueeze(-1)
            return self.out(y.amax(1)) * where.to(y.dtype)
        if self.running == "take":
            picked = y.index_select(1, torch.tensor([t - 2, 0, t - 2], device=y.device))
            return self.out(y[:, 0] + y[:, -1:].squeeze(1) * y[:, t - 3]) + picked.sum(1)
        if self.running == "softmax":  # attention pooling over the sequence
            weights = y.softmax(1) + y.log_softmax(1, dtype=torch.float64).exp()
            return self.out((weights * y).sum(1))
        return self.out(y.cumsum(dim=1))


def transformer_encoder(dim=32, heads=4, layers=2):
    layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class BiasedAttention(nn.Module):
    """Self-attention with a learned (heads, S, S) bias parameter as its float mask."""

    def __init__(self, seq: int, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.transpose(1, 2).reshape(b, t, c)


class DiTBlock(nn.Module):
    """A video diffusion transformer block as Open-Sora / PixArt write it: a 3-D patch
    embedding of the latent video (the sequence is born inside the model), adaLN-Zero
    modulation from the timestep, self-attention over the patches, cross-attention to a
    text embedding, an MLP; returns each patch's prediction (B, patches, values)."""

    def __init__(self, channels=4, patch=(1, 2, 2), dim=32, heads=4, text_dim=24, max_len=4096):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.patchify = nn.Conv3d(channels, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * 0.02)
        self.time = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.RMSNorm(dim // heads), nn.RMSNorm(dim // heads)
        self.norm2 = nn.LayerNorm(dim)
        self.cross_q, self.cross_kv = nn.Linear(dim, dim), nn.Linear(text_dim, 2 * dim)
        self.cross_proj = nn.Linear(dim, dim)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU("tanh"), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(dim, channels * patch[0] * patch[1] * patch[2])

    def _heads(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, video, timestep, text, text_mask=None):
        x = self.patchify(video).flatten(2).transpose(1, 2)  # (B, frames * rows * cols, dim)
        x = x + self.pos[:, : x.shape[1]]
        half = self.dim // 2
        steps = torch.arange(half, device=x.device, dtype=x.dtype)
        angles = timestep[:, None].to(x.dtype) * torch.exp(-math.log(10000.0) * steps / half)
        t = self.time(torch.cat([angles.cos(), angles.sin()], dim=-1))
        shift1, scale1, gate1, shift2, scale2, gate2 = t.unsqueeze(1).chunk(6, dim=-1)

        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = (self._heads(z) for z in self.qkv(h).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        x = x + gate1 * self.proj(y.transpose(1, 2).flatten(2))

        q = self._heads(self.cross_q(self.norm2(x)))
        k, v = (self._heads(z) for z in self.cross_kv(text).chunk(2, dim=-1))
        mask = None if text_mask is None else text_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.cross_proj(y.transpose(1, 2).flatten(2))

        x = x + gate2 * self.mlp(self.norm3(x) * (1 + scale2) + shift2)
        return self.out(x)


class FlexTransformer(nn.Module):
    """A torchtitan-style decoder whose attention is FlexAttention with a ``BlockMask`` built
    in ``forward`` from a ``mask_mod``: causal, or causal within documents (``docs``: a
    document id per position). ``attend="sdpa"`` is its twin: the same ``mask_mod`` applied
    to broadcast positions, as a dense bool mask for SDPA (for gradients on the CPU, where
    FlexAttention has no backward). ``alibi``: a ``score_mod`` adding ALiBi's bias with
    learned slopes, ``slopes[h] * (kv_idx - q_idx)`` (the twin adds it as a float mask)."""

    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=2, layers=2, attend="flex", alibi=False):
        super().__init__()
        self.heads, self.kv_heads, self.attend = heads, kv_heads, attend
        self.slopes = nn.Parameter(torch.linspace(-0.5, -0.05, heads)) if alibi else None
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.RMSNorm(dim),
                    "q": nn.Linear(dim, dim, bias=False),
                    "kv": nn.Linear(dim, 2 * dim * kv_heads // heads, bias=False),
                    "out": nn.Linear(dim, dim, bias=False),
                    "mlp_norm": nn.RMSNorm(dim),
                    "mlp": nn.Sequential(
                        nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)
                    ),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, docs=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            causal = q_idx >= kv_idx
            return causal if docs is None else causal & (docs[b, q_idx] == docs[b, kv_idx])

        batch, length = ids.shape
        if self.attend == "flex":
            mask = create_block_mask(mask_mod, batch, None, length, length, device=ids.device)
        else:
            positions = torch.arange(length, device=ids.device)
            b = torch.arange(batch, device=ids.device).view(-1, 1, 1, 1)
            mask = mask_mod(b, 0, positions.view(1, 1, -1, 1), positions.view(1, 1, 1, -1))
        score_mod, bias = None, None
        if self.slopes is not None:

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + self.slopes[h] * (kv_idx - q_idx)

            if self.attend != "flex":
                positions = torch.arange(length, device=ids.device)
                distance = positions.view(1, -1) - positions.view(-1, 1)
                bias = self.slopes.view(1, -1, 1, 1) * distance
                mask = bias.masked_fill(~mask, float("-inf"))
        x = self.embed(ids)
        for block in self.blocks:
            y = block["norm"](x)
            q = block["q"](y).view(batch, length, self.heads, -1).transpose(1, 2)
            k, v = block["kv"](y).view(batch, length, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
            if self.attend == "flex":
                y = flex_attention(q, k, v, score_mod, block_mask=mask, enable_gqa=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + block["out"](y.transpose(1, 2).reshape(batch, length, -1))
            x = x + block["mlp"](block["mlp_norm"](x))
        return self.head(x)


class AttendedRouter(nn.Module):
    """Causal attention (2 heads of 4), then a router over 4 experts of width 8: the opening
    of the small MoE layers the routing tests write after it (``attended``: the attention's
    output, (batch, sequence, 8))."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.router = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 8))

    def attended(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, 8)
