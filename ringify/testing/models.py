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


def transformer_decoder(dim=32, heads=4, layers=2):
    layer = nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
    return nn.TransformerDecoder(layer, layers)


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


class ConstantMaskAttention(nn.Module):
    """Attention under a causal mask built from constants, as research code writes it:
    ``einsum`` scores, ``ones((i, j)).triu(j - i + 1)`` filled (``how="einsum"``), an
    ``nn.MultiheadAttention`` given the mask (``how="mha"``, its weights asked for with
    ``need_weights``), SDPA under a causal mask extended with ``F.pad`` by 3 keys every
    query sees (``how="pad"``: a boolean mask padded on the left; ``"pad additive"``: a
    float mask padded on the left and the top), or under ALiBi's bias as x-transformers
    writes it (``"alibi"``: ``-|j - i| * slope`` from ``arange``, padded over the heads it
    leaves out, the causal triangle filled; ``"alibi cached"``: made once for 96 positions
    and kept as a buffer, then cut to the call's, as after x-transformers' first call)."""

    def __init__(self, dim=32, heads=4, how="einsum", need_weights=False):
        super().__init__()
        self.heads, self.how, self.need_weights = heads, how, need_weights
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        if how.startswith("alibi"):
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
            self.register_buffer("slopes", slopes.view(heads, 1, 1), persistent=False)
        if how == "alibi cached":
            self.register_buffer("bias", self._alibi(96, 96), persistent=False)

    def _alibi(self, i: int, j: int) -> torch.Tensor:
        keys, queries = (torch.arange(a, j, device=self.slopes.device) for a in (0, j - i))
        bias = -(keys.view(1, 1, j) - queries.view(1, i, 1)).abs() * self.slopes
        return F.pad(bias, (0, 0, 0, 0, 0, 0))  # the heads ALiBi leaves out: none

    def forward(self, x):
        b, n, c = x.shape
        if self.how == "mha":
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            return self.mha(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, -1))
        if self.how.startswith("alibi"):
            bias = self.bias[..., -n:, -n:] if self.how == "alibi cached" else self._alibi(n, n)
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
